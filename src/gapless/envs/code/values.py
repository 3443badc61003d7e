"""Plain values across a trust boundary: bounded JSON parsing and a tagged encoding of Python values.

Used on both sides of the code environment's boundaries, so it imports only the standard library
and is shipped into the sandbox as a job file (envs/code/environment.py):
- the host parses the report channel with `loads_bounded`;
- inside the sandbox the judge (trusted: it holds the tests) and the candidate's process
  (untrusted: it runs the completion) exchange calls and results as one line of JSON each
  (`encode` / `decode`), so nothing but builtin values ever crosses: no object of the
  candidate's, no `__eq__` it wrote, no reference into its memory.

Guaranteed: `loads_bounded` and `decode` never raise anything but `Malformed` on any input, and
never build a value deeper than `MAX_DEPTH`, an integer longer than `MAX_INT_DIGITS` digits or
a message longer than `MAX_MESSAGE_BYTES` (Python's own limits would raise `ValueError` past 4300
digits and `RecursionError` past about a thousand levels). `decode` builds only None, bool,
int, float, complex, str, bytes, list, tuple, dict, set and frozenset.
NOT guaranteed: `encode` is a convenience for the candidate's side and the judge's arguments;
on the candidate's side it runs untrusted, so its output is only ever read through `decode`.
"""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate

MAX_MESSAGE_BYTES = 1 << 20
MAX_DEPTH = 100
MAX_INT_DIGITS = 4000
_MAX_INT_BITS = int(MAX_INT_DIGITS * 3.32)  # 10**4000 needs 13288 bits
# A JSON string (unrolled-loop form: linear time, no backtracking) and the brackets outside one.
_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_BRACKET = r"[\[\]{}]"
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}
_FLOAT_NAMES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


class Malformed(ValueError):
    """A message that is not a bounded value of the encoding; the caller scores it as a failure."""


class Unrepresentable(ValueError):
    """A value with no plain-data form (an object, a function, too deep or too large)."""


def nesting_depth(text: str) -> int:
    """Deepest bracket nesting of JSON text, brackets inside strings excluded."""
    brackets = re.findall(_BRACKET, re.sub(_STRING, "", text, flags=re.S))  # compiled once, on first use
    return max(accumulate(_DELTA[b] for b in brackets), default=0)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise Malformed(f"integer with more than {MAX_INT_DIGITS} digits")
    return int(digits)


def loads_bounded(data: bytes | str) -> object:
    """json.loads within the bounds above; `Malformed` for anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise Malformed(f"message over {MAX_MESSAGE_BYTES} bytes")
    text = data.decode("utf-8", errors="replace") if isinstance(data, (bytes, bytearray)) else data
    try:
        if text.count("[") + text.count("{") > MAX_DEPTH and nesting_depth(text) > MAX_DEPTH:
            raise Malformed(f"nested deeper than {MAX_DEPTH}")
        return json.loads(text, parse_int=_bounded_int)
    except Malformed:
        raise
    except (ValueError, RecursionError, MemoryError) as error:
        raise Malformed(f"not JSON: {type(error).__name__}") from None


def encode(value: object) -> str:
    """One line of JSON for `value`; `Unrepresentable` if it has no plain-data form."""
    try:
        text = json.dumps(_tag(value, 0), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise Unrepresentable(f"{type(error).__name__}: {error}") from None
    if len(text) > MAX_MESSAGE_BYTES:
        raise Unrepresentable(f"value over {MAX_MESSAGE_BYTES} bytes encoded")
    return text


def decode(data: bytes | str) -> object:
    """The value `encode` wrote, rebuilt from builtin types only; `Malformed` otherwise."""
    try:
        return _untag(loads_bounded(data))
    except Malformed:
        raise
    except (TypeError, ValueError, KeyError, RecursionError) as error:  # e.g. an unhashable set member
        raise Malformed(f"not a value: {type(error).__name__}") from None


def _tag(value: object, depth: int) -> object:
    """JSON-native values as they are; every other kind as a one-key object naming it."""
    if depth > MAX_DEPTH:
        raise Unrepresentable(f"nested deeper than {MAX_DEPTH}")
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            raise Unrepresentable(f"integer over {MAX_INT_DIGITS} digits")
        return int(value)
    if isinstance(value, float):
        value = float(value)
        return value if value == value and abs(value) != float("inf") else {"f": repr(value)}
    if isinstance(value, complex):
        return {"c": [_tag(value.real, depth + 1), _tag(value.imag, depth + 1)]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return [_tag(item, depth + 1) for item in value]
    if isinstance(value, tuple):
        return {"t": [_tag(item, depth + 1) for item in value]}
    if isinstance(value, frozenset):
        return {"fs": [_tag(item, depth + 1) for item in value]}
    if isinstance(value, set):
        return {"s": [_tag(item, depth + 1) for item in value]}
    if isinstance(value, dict):
        return {"d": [[_tag(k, depth + 1), _tag(v, depth + 1)] for k, v in value.items()]}
    raise Unrepresentable(f"a {type(value).__name__} has no plain-data form")


def _untag(value: object) -> object:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_untag(item) for item in value]
    if type(value) is not dict or len(value) != 1:
        raise Malformed("an object that is not a tagged value")
    ((tag, body),) = value.items()
    if tag == "f" and body in _FLOAT_NAMES:
        return _FLOAT_NAMES[body]
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise Malformed(f"tag {tag!r} without a list")
    items = [_untag(item) for item in body]
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(items)
    if tag == "fs":
        return frozenset(items)
    if tag == "c" and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(*items)
    if tag == "d" and all(type(pair) is list and len(pair) == 2 for pair in items):
        return {k: v for k, v in items}
    raise Malformed(f"unknown tag {tag!r}")


class LineChannel:
    """One message per line over a stream fd (the judge's socket to the candidate). `receive`
    returns None at EOF and `b""` for a line over `MAX_MESSAGE_BYTES` (read and dropped)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""

    def send(self, text: str) -> None:
        data = (text + "\n").encode("utf-8", "surrogatepass")
        while data:
            data = data[os.write(self.fd, data) :]

    def receive(self) -> bytes | None:
        is_oversize = False
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                self._buffer, is_oversize = b"", True  # drop it; keep reading to its end
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:  # e.g. reset by a peer that died with unread data
                chunk = b""
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return b"" if is_oversize or len(line) > MAX_MESSAGE_BYTES else line
