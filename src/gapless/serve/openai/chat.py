"""Chat messages to prompt token ids: the tokenizer's own chat template, or a plain fallback.

With a chat template (`tokenizer.chat_template`), the messages are rendered and tokenized by
`apply_chat_template(..., add_generation_prompt=True, tokenize=True)`, straight to ids: no text
round trip and no special tokens added on top of the template's own (so no doubled BOS).
Without one (a checkpoint that ships none), each message becomes a "role: content" line and the
prompt ends with "assistant:". Content given as a list of text parts is joined with newlines.
Tools and tool-calling history (assistant `tool_calls`, `tool` messages) go through the template's
own tool support when it has some, else they are rewritten into plain messages in the server's
tool-call format first (tools/render.py). Not supported: images and audio parts (refused by the
request model, openai/params.py).
"""

from __future__ import annotations

import json
from typing import Sequence

from gapless.serve.openai.params import Message
from gapless.serve.protocol import InvalidRequest
from gapless.serve.tools.parsers import HERMES, ToolCallFormat
from gapless.serve.tools.render import plain_messages, template_takes_tools


def chat_prompt_ids(
    tokenizer,
    messages: Sequence[Message],
    tools: Sequence[dict] = (),
    fmt: ToolCallFormat = HERMES,
    add_generation_prompt: bool = True,
) -> list[int]:
    plain = [{"role": m.role, "content": m.text} for m in messages]
    tools_kw = {}
    if tools or any(m.role == "tool" or m.tool_calls for m in messages):
        if template_takes_tools(tokenizer):
            plain, tools_kw = [_template_message(m) for m in messages], {"tools": list(tools) or None}
        else:
            plain = [{"role": r, "content": c} for r, c in plain_messages([m.as_dict() for m in messages], tools, fmt)]
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(
                plain, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **tools_kw
            )
        except Exception as exc:  # noqa: BLE001 -- a template's own complaint (e.g. roles must alternate) is the user's to fix
            raise InvalidRequest(f"the model's chat template refused these messages: {exc}", "messages") from None
        return list(ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + ("assistant:" if add_generation_prompt else "")
    return tokenizer.encode(text, add_special_tokens=False)


def _template_message(m: Message) -> dict:
    """A message as HF chat templates take it: tool-call arguments as objects, not JSON text."""
    out = m.as_dict()
    for call in out.get("tool_calls", []):
        try:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        except ValueError:
            pass  # not JSON: the template gets the text as the client sent it
    return out
