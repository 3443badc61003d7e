"""Incremental text of one sample: stop strings found as tokens arrive, and a stream held back safely.

    add(all tokens so far) -> (new text to publish, whether a stop string appeared)

The whole token list is decoded each time (a byte-level BPE decode of a few hundred tokens costs
microseconds), so a token that completes a multi-byte character or a stop string split over
several tokens is handled without offsets. What is published is always a prefix of the final
text: the last (longest stop string - 1) characters are held back while they could still begin
a stop string, and a trailing U+FFFD (an incomplete UTF-8 sequence) waits for its next byte.
Guaranteed: the published pieces join to `final()`; `final()` ends before the first stop string.
Not guaranteed: that the token which completed a stop string spelled nothing after it (its text
past the stop string is cut, its id stays in the sample's token ids).
"""

from __future__ import annotations

from typing import Callable, Sequence


class SampleText:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._published = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Text new since the last call, and whether a stop string now ends the sample."""
        if self.stopped:
            return "", True
        text = self._decode(list(token_ids))
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._text, self.stopped = text[: min(hits)], True
            return self._take(len(self._text)), True
        self._text = text
        safe = len(text) - self._hold
        while safe > self._published and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._take(max(safe, self._published)), False

    def final(self) -> str:
        """The sample's whole text (stop string excluded)."""
        return self._text

    def rest(self) -> str:
        """What is not yet published: the last delta of a finished sample."""
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        piece = self._text[self._published : upto]
        self._published = max(self._published, upto)
        return piece
