"""Read a run's pipes concurrently, each up to a byte cap, until EOF or a deadline.

One `pump` call multiplexes every pipe of a run with `selectors` in the calling thread, so a run
costs no extra threads and a program cannot block the host by filling one pipe while we wait
on another.

Guaranteed: memory per pipe is bounded by its cap plus one read chunk; bytes beyond the cap are
read (so the writer never blocks on a full pipe) and dropped, and the sink records that.
`pump` never waits past its deadline.

NOT guaranteed: EOF. A pipe reaches EOF only when every process holding its write end is gone;
the caller must kill the run and close the read ends itself.
"""

from __future__ import annotations

import os
import select
import selectors
import time
from dataclasses import dataclass, field

READ_CHUNK_BYTES = 65536
_READ_EVENTS = select.POLLIN | select.POLLPRI


def ready(fds, timeout_s: float, write: bool = False) -> list[int]:
    """The fds of `fds` ready to read (or `write`) within `timeout_s` (an fd at EOF or with an
    error counts as ready, as with select). poll, not select: a host holding hundreds of
    sessions has fds beyond select's FD_SETSIZE (1024)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLOUT if write else _READ_EVENTS)
    fileno = {getattr(fd, "fileno", lambda fd=fd: fd)(): fd for fd in fds}
    return [fileno[fd] for fd, _ in poller.poll(max(timeout_s, 0.0) * 1000)]


@dataclass
class CappedSink:
    """Keeps the first `cap_bytes` bytes fed to it and counts the rest as dropped."""

    cap_bytes: int
    data: bytearray = field(default_factory=bytearray)
    dropped_bytes: int = 0

    @property
    def is_truncated(self) -> bool:
        return self.dropped_bytes > 0

    def feed(self, chunk: bytes) -> None:
        room = self.cap_bytes - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped_bytes += max(len(chunk) - room, 0)


def pump(sinks: dict[int, CappedSink], deadline: float, anchor: tuple[int, float] | None = None) -> bool:
    """Read every fd in `sinks` into its sink until all reach EOF or `time.monotonic()` passes
    `deadline`. Closes and removes each fd at its EOF; returns True when none is left.
    `anchor` (fd, seconds): when that fd first delivers bytes, the deadline becomes that moment
    plus the seconds (a program's clock starts at its start line, not at the sandbox's start)."""
    with selectors.DefaultSelector() as selector:
        for fd in sinks:
            selector.register(fd, selectors.EVENT_READ)
        while sinks:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return False
            for key, _ in selector.select(timeout=remaining_s):
                chunk = os.read(key.fd, READ_CHUNK_BYTES)
                if chunk and anchor is not None and key.fd == anchor[0]:
                    deadline, anchor = time.monotonic() + anchor[1], None
                if chunk:
                    sinks[key.fd].feed(chunk)
                    continue
                selector.unregister(key.fd)
                os.close(key.fd)
                del sinks[key.fd]
    return True
