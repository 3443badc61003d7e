"""Tool definitions and tool-calling history as plain chat messages, for templates without tool support.

A chat template that takes `tools` (its text mentions them: Qwen, Hermes, Llama 3.1 ...) renders
the conversation itself (serve/openai/chat.py passes `tools=` and the messages' `tool_calls`). A template
without tool support -- or no template, or the training gateway, whose transcripts are
(role, content) pairs -- gets the conversation rewritten here, in the tool-call format the server
parses (Hermes-like for 'hermes'):
    tools                 a system message (merged in front of the first one) listing each tool's
                          JSON definition between <tools> tags and how to call one
    assistant tool_calls  the content, then one `format.render(call)` block per call
    role "tool"           a user message `<tool_response>\n...\n</tool_response>` (consecutive
                          results joined in one message, in order)
Guaranteed: a reply sampled in the format and sent back as the assistant message with its parsed
`tool_calls` renders to the same blocks (name and arguments re-serialised as JSON); the training
gateway keeps its exact text instead (serve/gateway.py).
"""

from __future__ import annotations

import json
from typing import Sequence

from gapless.serve.tools.parsers import ToolCallFormat


def tools_system_text(tools: Sequence[dict], fmt: ToolCallFormat) -> str:
    """The instructions that list `tools` (OpenAI `{"type": "function", "function": {...}}` dicts)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.render("<function name>", {"<argument>": "<value>"})
    return (
        "You can call functions. Their definitions, one JSON object per line:\n<tools>\n" + listing + "\n</tools>\n"
        "To call one, reply with a JSON object naming it and giving its arguments, in this form:\n" + example
    )


def plain_messages(
    messages: Sequence[dict], tools: Sequence[dict] | None, fmt: ToolCallFormat
) -> list[tuple[str, str]]:
    """OpenAI-shaped message dicts (role, content, tool_calls, tool_call_id) -> (role, content) pairs."""
    out: list[tuple[str, str]] = []
    after_tool = False
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [fmt.render(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append(("assistant", "\n".join(([content] if content else []) + blocks)))
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if after_tool:
                out[-1] = ("user", out[-1][1] + "\n" + block)
            else:
                out.append(("user", block))
        else:
            out.append((role, content))
        after_tool = role == "tool"
    if tools:
        text = tools_system_text(tools, fmt)
        if out and out[0][0] in ("system", "developer"):
            out[0] = (out[0][0], out[0][1] + "\n\n" + text)
        else:
            out.insert(0, ("system", text))
    return out


def template_takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and "tool_calls" in template
