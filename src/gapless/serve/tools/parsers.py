"""Tool-call formats: how a model writes function calls in its text, parsed back into calls.

A format (`ToolCallFormat`) names the markers around one call's JSON object
(`{"name": ..., "arguments": {...}}`), so one description serves three uses: parsing a finished
reply (`parse`), parsing a stream as it arrives (`StreamParser`), and the grammar that forces
calls for `tool_choice` required / named (serve/tools/choice.py). Formats are looked up by name in
`TOOL_CALL_FORMATS` (the server's `tool_call_parser`, vLLM's flag name).

    hermes   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>     (Hermes 2/3, Qwen 2.5/3)

Model output is untrusted data: a block that is not a JSON object with a string `name` and an
object (or JSON-object string) `arguments`, or a block left open at the end, stays in the content
as the model wrote it; parsing never raises. Guaranteed: streaming the same text in any split
yields the same calls as `parse`, and the same content up to whitespace at its ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    open: str
    close: str
    separator: str = "\n"  # between consecutive calls in a forced (grammar) reply

    def render(self, name: str, arguments: dict | str) -> str:
        """One call as this format writes it (history rendering, forced calls)."""
        args = json.loads(arguments) if isinstance(arguments, str) and _is_object(arguments) else arguments
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        return f"{self.open}\n{body}\n{self.close}"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls, or None when only whitespace; the calls in order)."""
        stream = StreamParser(self)
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        content = (content + rest).strip()
        return (content or None), calls + more


class StreamParser:
    """Incremental parsing: feed text deltas, get (content delta, completed calls). Text that could
    still be the start of a call marker is held back until it cannot."""

    def __init__(self, fmt: ToolCallFormat):
        self.format = fmt
        self._buffer = ""  # unsent text: a possible marker prefix, or an open block
        self._calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            start = self._buffer.find(self.format.open)
            if start < 0:
                keep = _partial_suffix(self._buffer, self.format.open)
                content += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return content, calls
            end = self._buffer.find(self.format.close, start + len(self.format.open))
            if end < 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                return content, calls
            block = self._buffer[start : end + len(self.format.close)]
            content += self._buffer[:start]
            self._buffer = self._buffer[end + len(self.format.close) :]
            call = self._call(block[len(self.format.open) : -len(self.format.close)])
            if call is None:
                content += block
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held-back text (an unclosed block stays content) at the end of the reply."""
        rest, self._buffer = self._buffer, ""
        return rest, []

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or set(obj) - {"name", "arguments"}:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str) and _is_object(args):
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        self._calls += 1
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES,)}


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: {name!r} is not one of {sorted(TOOL_CALL_FORMATS)}") from None
