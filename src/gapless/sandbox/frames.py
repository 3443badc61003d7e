"""Replies of a session's live process (repl.py), read from untrusted bytes with bounded memory.

A frame is an 8-byte little-endian length, then that many bytes. A reply is one header frame,
JSON `{"ok": bool, "error": str | null}`, and for a snapshot whose header says ok also
`"snapshot_bytes": N` followed by one raw frame of exactly N bytes (the archive, opaque).
The model's code runs in the live process and holds its reply channel, so every byte here may be
forged: `ReplyReader` accepts exactly that grammar and turns anything else into a `violation`
(a reason, never an exception).

Guaranteed: memory is bounded by the cap of the frame being read (`HEADER_CAP_BYTES` for a
header, the caller's `blob_cap_bytes` for a snapshot) plus one read chunk: a frame declared
larger than its cap is refused from its length alone, before any of its body is kept; only a
header (at most `HEADER_CAP_BYTES`) is ever JSON-decoded; bytes after a complete reply, a
second header, wrong JSON types, unknown keys and a declared size that does not match are
violations. Error text is cut to `MAX_ERROR_CHARS` and holds no lone surrogate.
NOT guaranteed: that a well-formed reply came from repl.py rather than the model's code (the
host cannot tell; a forged reply only ever speaks for the model's own session).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gapless.text import unicode_text

LENGTH_BYTES = 8
HEADER_CAP_BYTES = 1 << 16  # a header is a few fields and an error text of <= 2000 characters
MAX_ERROR_CHARS = 2000
_HEADER_KEYS = frozenset({"ok", "error", "snapshot_bytes"})


@dataclass(frozen=True)
class Reply:
    """A reply that followed the grammar (its content is still the live process's word)."""

    ok: bool
    error: str | None
    blob: bytes | None = None  # a snapshot's archive


@dataclass(frozen=True)
class Violation:
    """Why the bytes on the reply channel are not a reply; `too_large`: a frame over its cap."""

    reason: str
    too_large: bool = False


class ReplyReader:
    """Feed it what the reply channel delivers; it says when the reply is complete or broken."""

    def __init__(self, expects_blob: bool = False, blob_cap_bytes: int = 0) -> None:
        self.expects_blob, self.blob_cap_bytes = expects_blob, blob_cap_bytes
        self.reply: Reply | None = None
        self.violation: Violation | None = None
        self._header: Reply | None = None
        self._blob_bytes = 0
        self._buffer = bytearray()  # the frame being read: its length, then its body

    @property
    def is_done(self) -> bool:
        return self.reply is not None or self.violation is not None

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the channel (b"" at its end)."""
        if self.violation is not None:
            return
        if self.reply is not None:
            if chunk:
                self.violation = Violation("bytes after the reply")
            return
        if not chunk:
            self.violation = Violation("the reply channel closed before a complete reply")
            return
        self._buffer += chunk
        while self.violation is None and self.reply is None and len(self._buffer) >= LENGTH_BYTES:
            size = int.from_bytes(self._buffer[:LENGTH_BYTES], "little")
            cap = self._blob_bytes if self._header is not None else HEADER_CAP_BYTES
            if size > cap or (self._header is not None and size != self._blob_bytes):
                self._buffer = bytearray()  # refused from its length: its body is never kept
                what = "snapshot" if self._header is not None else "header"
                self.violation = Violation(f"a {what} frame of {size} bytes (its cap: {cap})", too_large=size > cap)
                return
            if len(self._buffer) < LENGTH_BYTES + size:
                return
            body = bytes(memoryview(self._buffer)[LENGTH_BYTES : LENGTH_BYTES + size])
            del self._buffer[: LENGTH_BYTES + size]
            self._take(body)
        if self.reply is not None and self._buffer:
            self.violation = Violation("bytes after the reply")

    def _take(self, body: bytes) -> None:
        if self._header is not None:  # the snapshot's archive
            self.reply = Reply(True, self._header.error, body)
            return
        header = parse_header(body, self.expects_blob, self.blob_cap_bytes)
        if isinstance(header, Violation):
            self.violation = header
        elif header[0].ok and self.expects_blob:
            self._header, self._blob_bytes = header
        else:
            self.reply = header[0]


def parse_header(body: bytes, expects_blob: bool, blob_cap_bytes: int) -> tuple[Reply, int] | Violation:
    """A header frame's reply and its snapshot's size (0 without one), or why it is not one."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (bad UTF-8 included), or nesting built to break it
        return Violation("a header that is not JSON")
    if not isinstance(value, dict) or not set(value) <= _HEADER_KEYS or not isinstance(value.get("ok"), bool):
        return Violation("a header that is not an object with a boolean 'ok' and known keys")
    error = value.get("error")
    if error is not None and not isinstance(error, str):
        return Violation("a header whose 'error' is not text")
    size = value.get("snapshot_bytes")
    wants_size = expects_blob and value["ok"]
    if wants_size != (size is not None):
        return Violation("a header whose 'snapshot_bytes' does not fit the request")
    if size is not None and (type(size) is not int or not 0 <= size <= blob_cap_bytes):
        return Violation(
            f"a snapshot of {size!r} bytes (its cap: {blob_cap_bytes})",
            too_large=type(size) is int and size > blob_cap_bytes,
        )
    return Reply(value["ok"], clean_text(error)), size or 0


def clean_text(text: str | None, max_chars: int = MAX_ERROR_CHARS) -> str | None:
    """`text` cut to `max_chars`, each lone surrogate replaced (it could not be encoded later)."""
    if text is None:
        return None
    return unicode_text(text[:max_chars])
