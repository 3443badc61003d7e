"""OpenAI's Responses API (`POST /v1/responses`) as a chat request: the body in, chat's pipeline, items out.

    body.input (a string, or items) + instructions + tools + text.format
      ──> one chat-completions body (`ResponsesBody.chat_body`): the same template, tool rendering,
          tool-choice grammar and structured-output grammar as /v1/chat/completions
      ──> one sample ──> output items (responses_output.py), or their event stream

Input items: messages (roles system, developer, user, assistant; text parts), `function_call`
(joined to the assistant turn before it, as chat's `tool_calls`) and `function_call_output`
(a `tool` message). Tools: `{"type": "function", "name", "description", "parameters", "strict"}`;
`tool_choice` none / auto / required / `{"type": "function", "name"}`; `parallel_tool_calls`.
`text.format`: text, json_object, json_schema (`name`, `schema`, `strict`), served by the same
grammar as chat's `response_format`. Refused with a 400 naming the field: OpenAI's hosted tools
(web search, file search, computer use, MCP, ...), items that need stored state (`item_reference`,
`reasoning`, `previous_response_id`), image and file parts (a text-only model).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from gapless.serve.openai.params import REFUSED_PARTS, ChatBody, _Sampling, parse_body
from gapless.serve.protocol import InvalidRequest

_SAMPLING_FIELDS = tuple(name for name in _Sampling.model_fields if name not in ("n", "stream_options"))
_MESSAGE_ROLES = ("system", "developer", "user", "assistant")


class ResponsesBody(_Sampling):
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    previous_response_id: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self):
        if self.previous_response_id is not None:
            raise InvalidRequest(
                "responses are not stored (store is ignored): send the whole conversation as input",
                "previous_response_id",
            )
        if self.n != 1:
            raise InvalidRequest("the Responses API returns one output; use /v1/chat/completions for n > 1", "n")
        return self

    @property
    def text_format(self) -> dict:
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict):
            raise InvalidRequest("text.format must be an object with a type", "text.format")
        return fmt

    def chat_body(self) -> ChatBody:
        """The equivalent chat-completions body; a bad item or tool is a 400 naming its place here."""
        data = self.model_dump(include=set(_SAMPLING_FIELDS), exclude_unset=True, by_alias=True)
        data["messages"] = self._messages()
        if self.max_output_tokens is not None:
            data["max_tokens"] = self.max_output_tokens
        if self.tools:
            data["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            data["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            data["parallel_tool_calls"] = self.parallel_tool_calls
        if (fmt := _response_format(self.text_format)) is not None:
            data["response_format"] = fmt
        return parse_body(ChatBody, data)

    def _messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise InvalidRequest(f"input[{i}] must be an object", f"input.{i}")
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": _role(item, i), "content": _item_text(item.get("content"), i, "content")})
            elif kind == "function_call":
                call = _function_call(item, i)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id"), str):
                    raise InvalidRequest(f"input[{i}]: a function_call_output needs its call_id", f"input.{i}.call_id")
                output = _item_text(item.get("output"), i, "output")
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            else:
                raise InvalidRequest(
                    f"input[{i}]: items of type {kind!r} are not served (this server stores nothing and runs no "
                    "hosted tools); send messages, function_call and function_call_output items",
                    f"input.{i}.type",
                )
        return messages


def _role(item: dict, i: int) -> str:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise InvalidRequest(
            f"input[{i}]: a message needs a role (system, developer, user or assistant), got {role!r}", f"input.{i}"
        )
    return role


def _item_text(content: object, i: int, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{i}]: {field} must be text or a list of text parts", f"input.{i}.{field}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in REFUSED_PARTS:
            raise InvalidRequest(
                f"input[{i}]: content parts of type {kind!r} are not supported: the served model reads text only",
                f"input.{i}.{field}",
            )
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"input[{i}]: a content part must be input_text or output_text with a text (got {kind!r})",
                f"input.{i}.{field}",
            )
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict, i: int) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequest(f"input[{i}]: a function_call needs a string {key}", f"input.{i}.{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _chat_tool(tool: object, i: int) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise InvalidRequest(
            f"tools[{i}]: tools of type {kind!r} run on OpenAI's platform; this server serves function tools",
            f"tools.{i}.type",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice  # none / auto / required; anything else fails chat's validation, naming tool_choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        f"tool_choice of type {choice.get('type')!r} is not served; use none, auto, required or "
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(fmt: dict) -> dict | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format json_schema needs a schema object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest(f"text.format type {kind!r} is not one of text, json_object, json_schema", "text.format")
