"""Thread- and process-safe free-list of slots; a slot is a host uid owned by one run at a time.

Why slots: a uid used by one run only lets the host find and kill that run's whole process
tree by uid, and check that nothing of it is left (procs.py). It also keeps RLIMIT_NPROC per
run where the kernel counts it per host uid: before 5.14, or when the limit is set outside the
run's user namespace (measured: 40 runs sharing one uid that way, 26 failed to start).

Invariants: a slot is held by at most one run on the host. Within a process a lock guards the
free-list; across processes (environment workers are separate processes, all defaulting to the
same uid base) each held slot also holds an exclusive `flock` on `<lock_dir>/uid-<uid>.lock`,
which the kernel releases if the holder dies. The lowest free slot is handed out first, so uids
stay in a small range (base .. base + peak concurrency). A slot released as dirty is
quarantined: this allocator never hands it out again and keeps its lock while it lives.

NOT guaranteed: that the uid range is otherwise unused on the host (pick `uid_base` so it is),
nor any bound on concurrency (the pool's admission semaphore is the bound).

    run thread A --acquire()--> [lock: lowest free index whose flock we get] --> slot 0
    run thread B --acquire()--> [lock] --> slot 1   (or slot 2 if another process holds 1)
    run thread A --release(0, is_clean=True)--> [lock: unlock the file, push 0 back]
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
        self._free: list[int] = []  # heap of released clean indices
        self._next_index = 0
        self._held: dict[int, int | None] = {}  # index in use -> fd holding its flock
        self._quarantined: dict[int, int | None] = {}

    def acquire(self, exclude: frozenset[int] = frozenset()) -> int:
        """The lowest free index not in `exclude` (a retry asks for another slot)."""
        with self._lock:
            skipped: list[int] = []
            while True:
                index = heapq.heappop(self._free) if self._free else self._mint()
                if index not in exclude and self._try_claim(index):
                    break
                skipped.append(index)  # excluded, or held by another process for now
            for index_ in skipped:
                heapq.heappush(self._free, index_)
            return index

    def sweep(self, indices: list[int], clean: Callable[[int], None]) -> list[int]:
        """Call `clean(index)` for each index that no live process holds (its owner died),
        holding its flock meanwhile; returns the indices cleaned."""
        cleaned: list[int] = []
        for index in indices:
            with self._lock:
                if index in self._held or index in self._quarantined or not self._try_claim(index):
                    continue
            try:
                clean(index)
                cleaned.append(index)
            finally:
                with self._lock:
                    lock_fd = self._held.pop(index)
                    if lock_fd is not None:
                        os.close(lock_fd)
        return cleaned

    def close(self) -> None:
        """Drop every flock, quarantined slots' included (the caller has emptied them)."""
        with self._lock:
            for lock_fd in [*self._held.values(), *self._quarantined.values()]:
                if lock_fd is not None:
                    os.close(lock_fd)
            self._held.clear()
            self._quarantined.clear()

    def release(self, index: int, *, is_clean: bool) -> None:
        with self._lock:
            if index not in self._held:
                raise ValueError(f"slot {index} is not in use")
            lock_fd = self._held.pop(index)
            if not is_clean:
                self._quarantined[index] = lock_fd
                return
            if lock_fd is not None:
                os.close(lock_fd)  # closing the only fd of the open file drops its flock
            heapq.heappush(self._free, index)

    @property
    def quarantined(self) -> frozenset[int]:
        """Indices released dirty (leftover processes); never handed out again."""
        with self._lock:
            return frozenset(self._quarantined)

    def _mint(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index

    def _try_claim(self, index: int) -> bool:
        """Mark `index` held, with its flock when there is a lock dir; False if another
        process holds that flock."""
        lock_fd = None
        if self._lock_dir is not None:
            path = self._lock_dir / f"uid-{self._uid_base + index}.lock"
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                return False
        self._held[index] = lock_fd
        return True
