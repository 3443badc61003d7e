"""Thread- and process-safe slot allocator; a slot is a host uid used by one run at a time.

Why slots: a uid of its own per slot keeps bwrap unprivileged (bwrap started by root keeps
root's power), makes RLIMIT_NPROC per slot (measured: 40 runs sharing one uid, 26 failed to
start), and names the slot's cgroup. A warm slot also keeps a server running under its uid
between runs.

Invariants: an allocator owns each slot it has ever handed out until `close`: it holds an
exclusive `flock` on `<lock_dir>/uid-<uid>.lock` from the first `acquire` of that index on, so
no other process (environment workers are separate processes, all defaulting to the same uid
base) uses that uid, its cgroup or its server meanwhile; the kernel drops the lock if the owner
dies. Within the allocator a lock guards the free list, and a slot is held by at most one run.
The lowest free index is handed out first, so uids stay in a small range (base .. base + peak
concurrency + slots owned by other processes). A slot released as dirty is quarantined: never
handed out again.

NOT guaranteed: that the uid range is otherwise unused on the host (pick `uid_base` so it is),
nor any bound on concurrency (the pool's admission semaphore is the bound).

    run thread A --acquire()--> [lock: lowest free owned index, else mint one and flock it] --> 0
    run thread B --acquire()--> [lock] --> 1   (or 2 if another process owns uid base + 1)
    run thread A --release(0, is_clean=True)--> [lock: push 0 back; its flock stays held]
"""

from __future__ import annotations

import fcntl
import heapq
import os
import threading
from pathlib import Path
from typing import Callable


class SlotAllocator:
    """Hands out slot indices 0, 1, 2, ...; reuses released clean ones, lowest first.

    `lock_dir` None: no cross-process claim (for slots that are not host uids).
    """

    def __init__(self, uid_base: int = 0, lock_dir: Path | None = None) -> None:
        self._uid_base = uid_base
        self._lock_dir = lock_dir
        self._lock = threading.Lock()
        self._free: list[int] = []  # heap of owned, idle indices
        self._owned: dict[int, int | None] = {}  # index -> fd holding its flock
        self._busy: set[int] = set()
        self._quarantined: set[int] = set()

    def acquire(self, exclude: frozenset[int] = frozenset()) -> int:
        """The lowest free index not in `exclude` (a retry asks for another slot)."""
        with self._lock:
            skipped: list[int] = []
            while self._free and self._free[0] in exclude:
                skipped.append(heapq.heappop(self._free))
            if self._free:
                index = heapq.heappop(self._free)
            else:
                index = self._mint(exclude)
            for other in skipped:
                heapq.heappush(self._free, other)
            self._busy.add(index)
            return index

    def release(self, index: int, *, is_clean: bool) -> None:
        with self._lock:
            if index not in self._busy:
                raise ValueError(f"slot {index} is not in use")
            self._busy.remove(index)
            if is_clean:
                heapq.heappush(self._free, index)
            else:
                self._quarantined.add(index)

    @property
    def quarantined(self) -> frozenset[int]:
        """Indices released dirty (leftover processes); never handed out again."""
        with self._lock:
            return frozenset(self._quarantined)

    def sweep(self, indices: list[int], clean: Callable[[int], None]) -> list[int]:
        """Call `clean(index)` for each index that no live process owns (its owner died),
        holding its flock meanwhile; returns the indices cleaned."""
        cleaned: list[int] = []
        for index in indices:
            with self._lock:
                if index in self._owned:
                    continue
                lock_fd = self._try_lock(index)
                if lock_fd is False:
                    continue
            try:
                clean(index)
                cleaned.append(index)
            finally:
                if isinstance(lock_fd, int):
                    os.close(lock_fd)
        return cleaned

    def close(self) -> None:
        """Drop every flock (the caller has emptied the slots)."""
        with self._lock:
            for lock_fd in self._owned.values():
                if lock_fd is not None:
                    os.close(lock_fd)
            self._owned.clear()
            self._free.clear()
            self._busy.clear()

    def _mint(self, exclude: frozenset[int]) -> int:
        """The lowest index we do not own yet and whose flock we get (other processes own
        some; one that was theirs may be free again)."""
        index = 0
        while True:
            if index not in self._owned and index not in exclude:
                lock_fd = self._try_lock(index)
                if lock_fd is not False:
                    self._owned[index] = lock_fd
                    return index
            index += 1

    def _try_lock(self, index: int) -> int | None | bool:
        """The fd holding index's flock, None without a lock dir, False if another owns it."""
        if self._lock_dir is None:
            return None
        path = self._lock_dir / f"uid-{self._uid_base + index}.lock"
        lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            return False
        return lock_fd
