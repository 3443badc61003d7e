"""The trainer's inbox: every actor's messages, put by one reader thread per actor, read by the
trainer while it waits (pipeline.py `take`).

`meanwhile(kind, handle)` covers a span in which the trainer reads nothing (a training step): a
helper thread passes each message of type `kind` to `handle` as it arrives and keeps every other
message, in arrival order, for the trainer's next `get`.

Guaranteed: every message put is handled at most once, by `handle` or by a later `get`; the
messages kept back come out before any that arrived after the span; an exception raised by
`handle` is re-raised in the caller's thread when the span ends (the message it failed on is
not kept; later messages of `kind` are kept back unhandled). Not guaranteed: the order between a
message handled meanwhile and the ones kept back (that is the point); `handle` runs on another
thread, so whatever it touches must be left alone by the caller during the span.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

_WAKE = object()  # ends the helper


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._kept: deque = deque()

    def put(self, message) -> None:
        self._queue.put(message)

    def get(self, timeout: float):
        """The next message (kept-back ones first); raises queue.Empty after `timeout` seconds."""
        return self._kept.popleft() if self._kept else self._queue.get(timeout=timeout)

    @contextmanager
    def meanwhile(self, kind: type, handle: Callable) -> Iterator[None]:
        failure: list[BaseException] = []

        def serve() -> None:
            while (message := self._queue.get()) is not _WAKE:
                if isinstance(message, kind) and not failure:
                    try:
                        handle(message)
                    except BaseException as exc:  # re-raised in the caller's thread
                        failure.append(exc)
                else:
                    self._kept.append(message)

        helper = threading.Thread(target=serve, name="gapless-inbox", daemon=True)
        helper.start()
        try:
            yield
        finally:
            self._queue.put(_WAKE)
            helper.join()
        if failure:
            raise failure[0]
