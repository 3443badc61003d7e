"""`tool_choice` required / named as a grammar: the reply is nothing but valid calls.

The reply is forced into the server's tool-call format: one call (`parallel_tool_calls` false, or
a named choice) or one or more calls separated by the format's separator, each call's JSON object
`{"name": <one of the allowed tools>, "arguments": <valid against that tool's parameters schema>}`.
So the reply parses (parsers.py) into calls whose arguments validate, on any model, and the
tokens sampled are the same format the model writes unforced (what the training gateway records
and the history renders). A tool without `parameters` takes any JSON object.
"""

from __future__ import annotations

import json
from typing import Sequence

from gapless.serve.grammar import StructureSpec, json_schema_ebnf
from gapless.serve.tools.parsers import ToolCallFormat


def call_schema(tools: Sequence[dict]) -> dict:
    """The JSON schema of one call object among `tools` (OpenAI function tool dicts)."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_calls(tools: Sequence[dict], fmt: ToolCallFormat, parallel: bool) -> StructureSpec:
    """The grammar of a reply made of `fmt` calls to `tools`: exactly one, or one or more if `parallel`."""
    call = json_schema_ebnf(call_schema(tools))  # start rule `root`: one call object
    block = f"{_quote(fmt.open + chr(10))} root {_quote(chr(10) + fmt.close)}"
    more = f" ({_quote(fmt.separator)} {block})*" if parallel else ""
    return StructureSpec("ebnf", f"{call}\ntool_calls ::= {block}{more}\n", "tools", "tool_calls")


def _quote(text: str) -> str:
    return json.dumps(text)  # EBNF string literals take JSON's escapes
