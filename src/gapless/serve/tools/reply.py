"""A sampled reply as an OpenAI assistant message when tools were offered: content and `tool_calls`.

Non-streamed: `tool_message` parses the whole text. Streamed: one `ToolStream` per sample turns
text deltas into chunk deltas -- content as it arrives (held back only while it could still be a
call marker), and each call as one `tool_calls` delta (index, id, name and its whole arguments)
as soon as its block closes. Both give the same calls and, up to whitespace at its ends, the same
content. The finish reason is 'tool_calls' when a sample that stopped made at least one call;
a sample cut at max_tokens stays 'length' (an unfinished block is left in its content).
"""

from __future__ import annotations

from gapless.serve.tools.parsers import StreamParser, ToolCall, ToolCallFormat


def tool_message(text: str, finish_reason: str | None, fmt: ToolCallFormat) -> tuple[dict, str | None]:
    content, calls = fmt.parse(text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    return message, _finish(finish_reason, bool(calls))


class ToolStream:
    def __init__(self, fmt: ToolCallFormat):
        self._parser = StreamParser(fmt)
        self._calls = 0
        self._started = False  # leading whitespace before any content is dropped, as `parse` strips it

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        content, calls = self._parser.feed(text)
        if finish_reason is not None:
            rest, more = self._parser.finish()
            content, calls = content + rest, calls + more
        if not self._started:
            content = content.lstrip()
            self._started = bool(content)
        delta: dict = {"content": content}
        if calls:
            delta["tool_calls"] = [self._call_delta(c) for c in calls]
        return delta, _finish(finish_reason, self._calls > 0)

    def _call_delta(self, call: ToolCall) -> dict:
        self._calls += 1
        return {"index": self._calls - 1, **call.as_openai()}


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if reason == "stop" and called else reason
