"""Weight transport between processes: a double-buffered shared-memory state dict with a version.

The trainer `publish`es its weights into whichever of two shared buffers is not the current one,
then flips the published index and version under a lock. The generator `fetch`es the published
buffer into its engine while holding that buffer's lock, so the trainer never overwrites a buffer
being read; the trainer can only wait for one copy in progress on the *other* buffer, i.e. at
most one memory copy of the weights.

    trainer.publish(state, v) ──copy──> buffer[1 - current]  ──flip──>  current, version = v
    generator.fetch_into(load)         lock(buffer[current]) ─> load(views) ─> unlock

Guaranteed: a fetch never sees a torn state (each buffer is written only while unpublished and
unread); versions are monotonic; publishing costs one copy of the weights plus, at worst, the
wait for one reader's copy. Not guaranteed: that the generator sees every version (it takes the
newest; intermediate versions are skipped, which is what a staleness budget wants).
Works across processes made by any multiprocessing start method: the tensors live in shared
memory (`Tensor.share_memory_`) and travel by handle when the object is pickled.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from typing import Callable

import torch

from gapless.faults import fault_point


class SharedWeights:
    def __init__(self, state: dict[str, torch.Tensor], version: int, ctx=None):
        ctx = ctx or mp.get_context("spawn")
        self.names = list(state)
        self.buffers = [
            {name: torch.empty_like(t, device="cpu").share_memory_() for name, t in state.items()} for _ in range(2)
        ]
        self._locks = [ctx.Lock(), ctx.Lock()]
        # [published buffer index, published version, version held by buffer 0, by buffer 1]
        self._meta = ctx.Array("q", [0, version, version, -1])
        self._copy(self.buffers[0], state)

    @property
    def version(self) -> int:
        with self._meta.get_lock():
            return int(self._meta[1])

    def publish(
        self,
        state: dict[str, torch.Tensor],
        version: int,
        timeout_s: float | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> float:
        """Make `state` the weights of `version`; returns seconds spent waiting for a reader.
        A reader holding the buffer longer than `timeout_s` raises TimeoutError (a stalled
        generator); `while_waiting` is called every 0.1 s of such a wait and may raise sooner."""
        start = time.perf_counter()
        with self._meta_lock(version, timeout_s):
            target = 1 - int(self._meta[0])
            if version <= self._meta[1]:
                raise ValueError(f"version {version} is not newer than the published {self._meta[1]}")
        while not self._locks[target].acquire(timeout=0.1):
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                raise TimeoutError(
                    f"weight publish of version {version} waited {timeout_s:g} s for the generator to "
                    "finish reading the weight buffer (pipeline.stall_timeout_s)"
                )
            if while_waiting is not None:
                while_waiting()
        try:
            waited = time.perf_counter() - start
            half = len(self.names) // 2
            self._copy(self.buffers[target], {k: state[k] for k in self.names[:half]})
            fault_point("trainer", "publish")  # half the new weights copied, nothing flipped
            self._copy(self.buffers[target], {k: state[k] for k in self.names[half:]})
            with self._meta_lock(version, timeout_s):
                self._meta[2 + target] = version
        finally:
            self._locks[target].release()
        with self._meta_lock(version, timeout_s):
            self._meta[0], self._meta[1] = target, version
        return waited

    @contextlib.contextmanager
    def _meta_lock(self, version: int, timeout_s: float | None):
        """The version record's lock, bounded: a reader killed while holding it must not block
        the trainer for ever."""
        if not self._meta.get_lock().acquire(True, timeout_s):
            raise TimeoutError(f"weight publish of version {version} waited {timeout_s:g} s for the version record")
        try:
            yield
        finally:
            self._meta.get_lock().release()

    def fetch_into(self, load: Callable[[dict[str, torch.Tensor], int], None], have_version: int) -> int | None:
        """If a newer version than `have_version` is published, call `load(state, version)` on it
        (the views are valid only during the call) and return the version; else None."""
        with self._meta.get_lock():
            index, version = int(self._meta[0]), int(self._meta[1])
        if version <= have_version:
            return None
        with self._locks[index]:
            with self._meta.get_lock():
                version = int(self._meta[2 + index])  # what this buffer holds (it may be newer)
            fault_point("generator", "fetch")
            load(self.buffers[index], version)
        return version

    @staticmethod
    def _copy(target: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in state.items():
                target[name].copy_(tensor)
