"""Incremental text of one sample: stop strings found as tokens arrive, and a stream held back safely.

    add(all tokens so far) -> (new text to publish, whether a stop string appeared)

Each call decodes only the last few tokens: the text of tokens[p:] minus that of tokens[p:r],
where r is how far the text is settled and p a few tokens before it (vLLM's prefix/read offsets:
the context token keeps a leading space or a byte-level merge decoding as it does in the whole
sequence), so a step costs the same at token 10 and at token 10,000. Text ending in U+FFFD (an
incomplete UTF-8 sequence) is not settled until its next byte arrives; if a window ever decodes
inconsistently, the whole list is decoded instead. What is published is always a prefix of the
final text: the last (longest stop string - 1) characters are held back while they could still
begin a stop string, and a trailing U+FFFD waits for its next byte.
Guaranteed: the published pieces join to `final()`; `final()` ends before the first stop string.
Not guaranteed: that the token which completed a stop string spelled nothing after it (its text
past the stop string is cut, its id stays in the sample's token ids).
"""

from __future__ import annotations

from typing import Callable, Sequence

CONTEXT_TOKENS = 4  # tokens decoded before the settled point, so its first new token decodes in context


class SampleText:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._settled, self._settled_tokens = "", 0  # text of tokens[:r], and r
        self._text = ""
        self._published = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Text new since the last call (all of `token_ids` is the sample so far), and whether a
        stop string now ends the sample."""
        if self.stopped:
            return "", True
        before = len(self._text)
        self._text = self._settle(token_ids)
        hits = [i for i in (self._text.find(s, max(0, before - len(s) - 8)) for s in self._stop) if i >= 0]
        if hits:
            self._text, self.stopped = self._text[: min(hits)], True
            return self._take(len(self._text)), True
        safe = len(self._text) - self._hold
        while safe > self._published and self._text[safe - 1] == "\ufffd":
            safe -= 1
        return self._take(max(safe, self._published)), False

    def _settle(self, tokens: list[int]) -> str:
        """The whole text of `tokens`, decoding only the window past the settled point."""
        r = self._settled_tokens
        p = max(0, r - CONTEXT_TOKENS)
        head, window = self._decode(list(tokens[p:r])), self._decode(list(tokens[p:]))
        if not window.startswith(head):  # a decoder that is not prefix-stable here: decode everything
            text = self._decode(list(tokens))
            self._settled, self._settled_tokens = (
                (text, len(tokens)) if not text.endswith("\ufffd") else (self._settled, r)
            )
            return text
        text = self._settled + window[len(head) :]
        if not text.endswith("\ufffd"):
            self._settled, self._settled_tokens = text, len(tokens)
        return text

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
