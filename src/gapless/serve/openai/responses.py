"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: text in, text out.

    body.input (a string, or message items)  ──> chat messages (instructions first, as a system message)
    ──> the chat template (chat.py) ──> one sample ──> a `response` object, or its event stream

Streaming sends the event sequence the openai client and openai-agents read: response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta per engine step,
output_text.done, content_part.done, output_item.done, response.completed (each with its
`sequence_number`). A sample cut by `max_output_tokens` is `status: "incomplete"` with reason
`max_output_tokens` (streamed, still in a `response.completed` event, as vLLM sends it: the
clients' stream helpers wait for that event). Nothing is stored: `previous_response_id` is refused (send the whole
conversation as `input`). Not served here: function tools and their items (`function_call`,
`function_call_output`) and structured `text.format`, answered 501 naming /v1/chat/completions,
which serves them; image and file parts (400, text-only model).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from pydantic import Field, model_validator

from gapless.serve.openai.params import REFUSED_PARTS, Message, _Sampling
from gapless.serve.protocol import InvalidRequest, SampleResult, ServeError, merge_deltas
from gapless.serve.scheduler import RequestHandle


class NotServedHere(ServeError):
    status, type, code = 501, "invalid_request_error", "not_implemented"


class ResponsesBody(_Sampling):
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict | None = None
    text: dict | None = None
    previous_response_id: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self):
        if self.tools or self.tool_choice not in (None, "auto", "none"):
            raise NotServedHere(
                "function tools are not served on /v1/responses; use /v1/chat/completions with tools", "tools"
            )
        if (self.text or {}).get("format", {"type": "text"}).get("type", "text") != "text":
            raise NotServedHere(
                "structured text.format is not served on /v1/responses; use /v1/chat/completions with response_format",
                "text.format",
            )
        if self.previous_response_id is not None:
            raise InvalidRequest(
                "responses are not stored (store is ignored): send the whole conversation as input",
                "previous_response_id",
            )
        return self

    def messages(self) -> list[Message]:
        system = [Message(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return system + [Message(role="user", content=self.input)]
        return system + [_message(item, i) for i, item in enumerate(self.input)]


def _message(item: dict, i: int) -> Message:
    kind = item.get("type", "message")
    if kind != "message":
        raise NotServedHere(
            f"input[{i}]: items of type {kind!r} are not served on /v1/responses; use "
            "/v1/chat/completions (tool calls and their outputs are messages there)",
            f"input.{i}",
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in REFUSED_PARTS:
                raise InvalidRequest(
                    f"input[{i}]: content parts of type {kind!r} are not supported: the served model reads text only",
                    f"input.{i}.content",
                )
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"input[{i}]: a content part must be input_text or output_text with a text (got {kind!r})",
                    f"input.{i}.content",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if item.get("role") not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
        raise InvalidRequest(
            f"input[{i}]: a message needs a role (system, developer, user or assistant) and text content", f"input.{i}"
        )
    return Message(role=item["role"], content=content)


def response_object(
    body: ResponsesBody, model: str, rid: str, created: int, result: SampleResult | None, prompt_tokens: int
) -> dict:
    """The `response` object; `result` None: one still in progress (the stream's first events)."""
    output, status, incomplete, usage = [], "in_progress", None, None
    if result is not None:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        output = [_message_item(rid, result.text, "completed")]
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(result.token_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + len(result.token_ids),
        }
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": body.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }


def _message_item(rid: str, text: str, status: str) -> dict:
    part = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {
        "id": f"msg_{rid.removeprefix('resp_')}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": part,
    }


async def response_events(body: ResponsesBody, model: str, handle: RequestHandle) -> AsyncIterator[str]:
    """The server-sent events of one streamed response (the handle is aborted when the client goes)."""
    rid, created, seq = f"resp_{uuid.uuid4().hex}", int(time.time()), iter(range(1 << 62))
    item_id, prompt_tokens = f"msg_{rid.removeprefix('resp_')}", len(handle.request.prompt_ids)

    def event(kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": next(seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    try:
        head = response_object(body, model, rid, created, None, prompt_tokens)
        yield event("response.created", response=head) + event("response.in_progress", response=head)
        yield (
            event("response.output_item.added", output_index=0, item=_message_item(rid, "", "in_progress"))
            + event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
        )
        async for batch in handle.adeltas():
            text = "".join(d.text for d in merge_deltas(batch))
            if text:
                yield event("response.output_text.delta", **where, delta=text, logprobs=[])
        result = handle.results[0]
        part = {"type": "output_text", "text": result.text, "annotations": [], "logprobs": []}
        done = response_object(body, model, rid, created, result, prompt_tokens)
        yield (
            event("response.output_text.done", **where, text=result.text, logprobs=[])
            + event("response.content_part.done", **where, part=part)
            + event("response.output_item.done", output_index=0, item=done["output"][0])
            + event("response.completed", response=done)
        )
    except ServeError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
    finally:
        handle.abort()
