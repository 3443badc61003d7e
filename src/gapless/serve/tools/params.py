"""The tool-calling request fields, as strict pydantic models (OpenAI's chat-completions shapes).

    tools                [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
    tool_choice          "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls  default true
    messages             assistant `tool_calls` [{"id", "type": "function", "function": {"name", "arguments"}}],
                         and {"role": "tool", "tool_call_id", "content"}

Refused (400 naming the field): tool types other than "function" (OpenAI's built-in tools run on
OpenAI's side), a tool_choice naming a tool not in `tools`, tool_choice other than "none" without
tools, two tools with one name.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", value):
            raise ValueError("a function name is 1 to 64 letters, digits, '_', '.' or '-'")
        return value


class ToolParam(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallParam(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(_Strict):
    """Mixed into the chat body (openai/params.py)."""

    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: the function {self.tool_choice.function.name!r} is not in tools ({names})")
        return self

    @property
    def tool_dicts(self) -> list[dict]:
        """The tools as plain OpenAI dicts (rendering, grammar), none when tool_choice is 'none'."""
        if self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def forced_tools(self) -> list[dict] | None:
        """The tools a reply must call (required: any of them; named: that one), or None (auto / none)."""
        if self.tool_choice == "required":
            return self.tool_dicts
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tool_dicts if t["function"]["name"] == self.tool_choice.function.name]
        return None
