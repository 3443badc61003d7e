"""A Responses API sample as output items: the `response` object, and its server-sent events.

Output items, in order: a `message` item with the text (left out when tools were offered and the
reply is only calls), then one `function_call` item per call the tool-call format parsed out of
the reply (`call_id` links it to the `function_call_output` the client sends back). A sample cut
by `max_output_tokens` is `status: "incomplete"`, reason `max_output_tokens`.

Streaming sends the event sequence the openai client and openai-agents read: response.created,
response.in_progress; per message item output_item.added, content_part.added, output_text.delta
per engine step, output_text.done, content_part.done, output_item.done; per call
output_item.added, function_call_arguments.delta (the whole arguments: a call is sent once its
block closes), function_call_arguments.done, output_item.done; then response.completed (also for
an incomplete response, as vLLM sends it: the clients' stream helpers wait for that event). Every
event has its `sequence_number`; the final response's items are the streamed ones, ids included.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from gapless.serve.openai.responses import ResponsesBody
from gapless.serve.protocol import SampleResult, ServeError, merge_deltas
from gapless.serve.scheduler import RequestHandle
from gapless.serve.tools.parsers import ToolCall, ToolCallFormat
from gapless.serve.tools.reply import ToolStream


def output_items(result: SampleResult, fmt: ToolCallFormat | None) -> list[dict]:
    """The finished sample's items; `fmt` None: no tools were offered, the text is all there is."""
    if fmt is None:
        return [message_item(result.text, "completed")]
    content, calls = fmt.parse(result.text)
    items = [message_item(content, "completed")] if content or not calls else []
    return items + [function_call_item(call, "completed") for call in calls]


def message_item(text: str | None, status: str) -> dict:
    part = {"type": "output_text", "text": text or "", "annotations": [], "logprobs": []}
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def function_call_item(call: ToolCall, status: str) -> dict:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


def response_object(
    body: ResponsesBody,
    model: str,
    rid: str,
    created: int,
    result: SampleResult | None,
    prompt_tokens: int,
    output: list[dict] | None = None,
) -> dict:
    """The `response` object; `result` None: one still in progress (the stream's first events)."""
    status, incomplete, usage = "in_progress", None, None
    if result is not None:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
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
        "output": output or [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": body.temperature,
        "text": {"format": body.text_format},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }


async def response_events(
    body: ResponsesBody, model: str, handle: RequestHandle, fmt: ToolCallFormat | None
) -> AsyncIterator[str]:
    """The server-sent events of one streamed response (the handle is aborted when the client goes)."""
    rid, created, seq = f"resp_{uuid.uuid4().hex}", int(time.time()), iter(range(1 << 62))
    items: list[dict] = []
    message: dict | None = None  # the open message item
    text: list[str] = []
    tools = ToolStream(fmt) if fmt is not None else None

    def event(kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": next(seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def where() -> dict:
        return {"item_id": message["id"], "output_index": items.index(message), "content_index": 0}

    def open_message() -> str:
        nonlocal message
        message = message_item(None, "in_progress")
        items.append(message)
        empty = {"type": "output_text", "text": "", "annotations": []}
        return event("response.output_item.added", output_index=len(items) - 1, item=message) + event(
            "response.content_part.added", **where(), part=empty
        )

    def call_events(call: ToolCall) -> str:
        item = function_call_item(call, "in_progress")
        items.append(item)
        at = {"item_id": item["id"], "output_index": len(items) - 1}
        item_done = {**item, "status": "completed", "arguments": call.arguments}
        items[-1] = item_done
        return (
            event("response.output_item.added", output_index=at["output_index"], item=item)
            + event("response.function_call_arguments.delta", **at, delta=call.arguments)
            + event("response.function_call_arguments.done", **at, name=call.name, arguments=call.arguments)
            + event("response.output_item.done", output_index=at["output_index"], item=item_done)
        )

    try:
        head = response_object(body, model, rid, created, None, len(handle.request.prompt_ids))
        yield event("response.created", response=head) + event("response.in_progress", response=head)
        if tools is None:
            yield open_message()
        async for batch in handle.adeltas():
            out = []
            for d in merge_deltas(batch):
                content, calls = d.text, []
                if tools is not None:
                    delta, _ = tools.delta(d.text, d.finish_reason)
                    content, calls = delta["content"], [_call(c) for c in delta.get("tool_calls", [])]
                if content:
                    if message is None:
                        out.append(open_message())
                    text.append(content)
                    out.append(event("response.output_text.delta", **where(), delta=content, logprobs=[]))
                out.extend(call_events(call) for call in calls)
            yield "".join(out)
        result = handle.results[0]
        if message is not None:
            part = {"type": "output_text", "text": "".join(text), "annotations": [], "logprobs": []}
            at, done = where(), {**message, "status": "completed", "content": [part]}
            items[at["output_index"]] = done
            yield (
                event("response.output_text.done", **at, text=part["text"], logprobs=[])
                + event("response.content_part.done", **at, part=part)
                + event("response.output_item.done", output_index=at["output_index"], item=done)
            )
        final = response_object(body, model, rid, created, result, len(handle.request.prompt_ids), items)
        yield event("response.completed", response=final)
    except ServeError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
    finally:
        handle.abort()


def _call(delta: dict) -> ToolCall:
    function = delta["function"]
    return ToolCall(function["name"], function["arguments"], delta["id"])
