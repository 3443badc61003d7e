"""The futures the Tinker SDK polls: every call answers `{"request_id"}` at once, its result later.

    route (event loop) ── create() ──> FutureStore ──> request_id to the SDK
    worker (training thread, scheduler handle, ...) ── resolve(id, Outcome) ──> wakes the pollers
    POST /retrieve_future ── await wait(id, hold_s) ──> the Outcome, or None: "try_again"

`create`, `wait` and the sweep run on the event loop; `resolve` may be called from any thread (it
hops onto the loop with `call_soon_threadsafe`). The SDK re-polls at once after "try_again", so
`wait` holds the poll up to `hold_s` instead of answering immediately.
Guaranteed: an outcome can be fetched again until `ttl_s` after it was resolved (the SDK retries a
poll whose reply it lost); unresolved futures are kept as long as their work runs; a future
nobody polls any more is swept after `ttl_s`, so abandoned results do not pile up.
Not guaranteed: a result fetched after its TTL (the SDK then sees 404 and raises), or any result
of a process that died: a later process only recognises its ids as another process's (`earlier`).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from dataclasses import dataclass

_REQUEST_ID = re.compile(r"req-(?P<prefix>[0-9a-f]{8})-\d+(~(?P<tag>.+))?", re.DOTALL)


@dataclass(frozen=True)
class Outcome:
    """A finished call: a JSON body, or protobuf bytes (the SDK's proto result types), or an error
    the SDK raises as `RequestFailedError` with this category ("user": fix the request; "server")."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"

    def __post_init__(self):
        if sum(x is not None for x in (self.json, self.proto, self.error)) != 1:
            raise ValueError("an Outcome is exactly one of json, proto or error")


class FutureStore:
    def __init__(self, ttl_s: float = 600.0):
        self.ttl_s = ttl_s
        self._outcomes: dict[str, Outcome] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._resolved_at: dict[str, float] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._events)

    def create(self, tag: str | None = None) -> str:
        """A new future's id: this process's prefix, a number, and `tag` (what the call worked on,
        e.g. a model id), which a later process reads back with `earlier` if this one dies."""
        self._loop = asyncio.get_running_loop()
        self._sweep()
        request_id = f"req-{self._prefix}-{next(self._ids)}" + (f"~{tag}" if tag else "")
        self._events[request_id] = asyncio.Event()
        return request_id

    def earlier(self, request_id: str) -> tuple[bool, str | None]:
        """(whether `request_id` was made by another process of the service, its tag): a future
        lost to a restart, as opposed to one this process never made or has expired."""
        match = _REQUEST_ID.fullmatch(request_id)
        if match is None or match["prefix"] == self._prefix:
            return False, None
        return True, match["tag"]

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Any thread: record the outcome and wake whoever polls it."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("resolve() before any create(): the store has no event loop")
        try:
            loop.call_soon_threadsafe(self._set, request_id, outcome)
        except RuntimeError:  # the loop has closed: the service is shutting down, nobody polls
            pass

    def _set(self, request_id: str, outcome: Outcome) -> None:
        if (event := self._events.get(request_id)) is None:
            return
        self._outcomes[request_id] = outcome
        self._resolved_at[request_id] = time.monotonic()
        event.set()

    def known(self, request_id: str) -> bool:
        return request_id in self._events

    async def wait(self, request_id: str, hold_s: float) -> Outcome | None:
        """The outcome, waiting at most `hold_s` for it; None if still running. KeyError: unknown id."""
        event = self._events[request_id]
        if not event.is_set():
            try:
                await asyncio.wait_for(event.wait(), hold_s)
            except asyncio.TimeoutError:
                return None
        return self._outcomes[request_id]

    def _sweep(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for request_id in [r for r, t in self._resolved_at.items() if t < cutoff]:
            del self._resolved_at[request_id], self._outcomes[request_id], self._events[request_id]
