"""Weights to generator replicas anywhere in a Ray cluster, through Ray's object store
(`cluster.weight_transport = 'object_store'`).

    trainer: publish(state, v) ──copy──> staging[free half]         (the trainer's blocking part: one memory copy)
    relay thread: ray.put(staging bytes) ──> WeightBoard: newest (v, digest, ref), two refs kept
    replica's receiver thread: long poll board ──> ray.get(ref) ──copy──> landing[unpublished half] ──check──> flip
    replica's generator: fetch_into(load) reads landing[published half] between decode steps (as SharedWeights)

The state is packed into one flat byte buffer per version (each tensor a view at a 64-byte
aligned offset), so a version is one object, one put and one pull, whatever the dtypes (bf16
included: bytes, never pickled tensors). The digest (names, shapes, dtypes) travels with each
version and must match what the receiver was built for.

Guaranteed: the trainer never waits for a replica or the network: `publish` copies into the
staging half the relay thread is not reading (it waits at most for one put of the other half to
finish copying out); versions a replica exposes are monotonic (a version not newer than what it
holds is ignored) and never torn (a version lands in the unpublished half and is flipped to only
after every byte arrived and its size and digest checked out; a failed pull leaves that half
unpublished); the board keeps only the two newest versions' objects alive, so the object store
holds a bounded amount. Not guaranteed: that a replica sees every version (it takes the newest,
as with SharedWeights); how soon a replica flips (the relay's latency, bench/distributed.py).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable

import numpy as np
import ray
import torch

from gapless.cluster.ray.mail import POLL_S, _call
from gapless.faults import fault_point

ALIGN = 64


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class WeightBoard:
    """The newest published versions: (version, nbytes, digest, ref); long-polled by receivers."""

    def __init__(self):
        self.versions: list[tuple[int, int, str, list]] = []  # oldest first, at most two
        self.changed = None

    async def post(self, version: int, nbytes: int, digest: str, ref: list) -> None:
        import asyncio

        if self.changed is None:
            self.changed = asyncio.Condition()
        async with self.changed:
            if not self.versions or version > self.versions[-1][0]:
                self.versions = (self.versions + [(version, nbytes, digest, ref)])[-2:]
            self.changed.notify_all()

    async def newest(self, have: int, wait_s: float):
        """The newest (version, nbytes, digest, [ref]) newer than `have`, waiting up to `wait_s`; else None."""
        import asyncio

        if self.changed is None:
            self.changed = asyncio.Condition()
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: self.versions and self.versions[-1][0] > have), wait_s
                )
            except asyncio.TimeoutError:
                return None
            return self.versions[-1]


class Layout:
    """Where each tensor of a state dict lives in one flat byte buffer."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.entries: list[
            tuple[str, tuple[int, ...], torch.dtype, int, int]
        ] = []  # name, shape, dtype, offset, nbytes
        offset = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            self.entries.append((name, tuple(t.shape), t.dtype, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = offset
        self.digest = hashlib.sha1(repr([(n, s, str(d)) for n, s, d, _, _ in self.entries]).encode()).hexdigest()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[off : off + n].view(dtype).view(shape) for name, shape, dtype, off, n in self.entries}


class StagedPublish:
    """The trainer's blocking part of a relay: one copy into the older of two staging halves
    (`views`, `locks`, `held`), then `version` and `_published_at` under `_news`; the sender's relay
    thread ships the newer half. Used by the object-store and the broadcast senders."""

    def publish(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Copy `state` into the free staging half as `version`; returns seconds waited for it."""
        if self.error is not None:
            raise RuntimeError(f"the weight relay failed: {self.error!r}") from self.error
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the published {self.version}")
        target = 0 if self.held[0] < self.held[1] else 1  # the older half; the relay reads the newer one
        start = time.perf_counter()
        with self.locks[target]:
            waited = time.perf_counter() - start
            with torch.no_grad():
                for name, view in self.views[target].items():
                    view.copy_(state[name])
            self.held[target] = version
        with self._news:
            self.version = version
            self._published_at[version] = time.perf_counter()
            self._news.notify_all()
        return waited


class ObjectStoreSender(StagedPublish):
    """The trainer's side: a two-half staging buffer and the relay thread."""

    def __init__(self, board, state: dict[str, torch.Tensor]):
        self.board, self.layout = board, Layout(state)
        self.halves = [torch.empty(self.layout.nbytes, dtype=torch.uint8) for _ in range(2)]
        self.views = [self.layout.views(h) for h in self.halves]
        self.locks = [threading.Lock(), threading.Lock()]
        self.held = [-1, -1]  # version in each half
        self.version = -1  # newest published
        self.relayed = -1  # newest on the board
        self.relay_s: list[tuple[int, float]] = []  # (version, seconds from publish to on the board)
        self.error: BaseException | None = None
        self._news = threading.Condition()
        self._published_at: dict[int, float] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._relay, name="weight-relay", daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        try:
            while True:
                with self._news:
                    self._news.wait_for(lambda: self._closed or self.version > self.relayed)
                    if self._closed:
                        return
                half = 0 if self.held[0] > self.held[1] else 1
                if not ray.is_initialized():
                    return  # the run's connection is closed
                with self.locks[half]:
                    version = self.held[half]
                    ref = ray.put(self.halves[half].numpy())  # one copy into the object store
                _call(lambda: self.board.post.remote(version, self.layout.nbytes, self.layout.digest, [ref]))
                with self._news:
                    self.relayed = version
                    self.relay_s.append(
                        (version, time.perf_counter() - self._published_at.pop(version, time.perf_counter()))
                    )
                    self._news.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported on the next publish
            self.error = exc

    def wait_relayed(self, version: int, timeout_s: float) -> bool:
        with self._news:
            return self._news.wait_for(lambda: self.relayed >= version or self.error is not None, timeout_s)

    def close(self) -> None:
        with self._news:
            self._closed = True
            self._news.notify_all()


class RelayedWeights:
    """What both Ray relays' replica handles share (ObjectStoreWeights, broadcast.BroadcastWeights):
    on the trainer, `publish` through the shared sender; pickled into a replica, two halves of
    the flat weights, one being filled by the subclass's `_receive` thread while the other is read
    (`fetch_into`, SharedWeights.fetch_into's contract). Subclasses set `sender`, `layout` and
    `first_timeout_s`, call `_buffers()` in `__setstate__`, and say what a late first version is
    (`_first_timeout`)."""

    @property
    def version(self) -> int:
        return self.sender.version if self.sender is not None else self._version

    def publish(self, state, version: int, timeout_s: float | None = None, while_waiting=None) -> float:
        if version <= self.sender.version:
            return 0.0  # another replica's handle published it already: one staging copy per version
        return self.sender.publish(state, version)

    def _buffers(self) -> None:
        self.sender = None
        n = self.layout.nbytes
        self.halves = [torch.empty(n, dtype=torch.uint8) for _ in range(2)]
        self.views = [self.layout.views(h) for h in self.halves]
        self.locks = [threading.Lock(), threading.Lock()]
        self.held = [-1, -1]
        self.current = 0
        self._version = -1
        self._meta = threading.Condition()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _first_timeout(self) -> TimeoutError:
        raise NotImplementedError

    def _receive(self) -> None:
        raise NotImplementedError

    def fetch_into(self, load: Callable[[dict[str, torch.Tensor], int], None], have_version: int) -> int | None:
        """SharedWeights.fetch_into: load the newest version if newer than `have_version`. The first
        call (have_version -1) waits for the first version to arrive."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive, name="weight-receiver", daemon=True)
            self._thread.start()
        with self._meta:
            if have_version < 0 and not self._meta.wait_for(
                lambda: self._version >= 0 or self.error, self.first_timeout_s
            ):
                raise self._first_timeout()
            if self.error is not None:
                raise RuntimeError(f"the weight receiver failed: {self.error!r}") from self.error
            index, version = self.current, self._version
        if version <= have_version:
            return None
        with self.locks[index]:
            fault_point("generator", "fetch")
            load(self.views[index], self.held[index])
        return self.held[index]


class ObjectStoreWeights(RelayedWeights):
    """One replica's weights: on the trainer, a handle on the shared sender (SharedWeights.publish's
    signature); pickled into the replica's actor, a receiver with SharedWeights.fetch_into's."""

    def __init__(self, sender: ObjectStoreSender, op_timeout_s: float, first_timeout_s: float):
        self.sender, self.board = sender, sender.board
        self.layout, self.op_timeout_s, self.first_timeout_s = sender.layout, op_timeout_s, first_timeout_s

    # ---- the replica's side --------------------------------------------------------------------
    def __getstate__(self):
        return {
            "board": self.board,
            "layout": self.layout,
            "op_timeout_s": self.op_timeout_s,
            "first_timeout_s": self.first_timeout_s,
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._buffers()

    def _first_timeout(self) -> TimeoutError:
        return TimeoutError(
            f"no weights reached this replica within {self.first_timeout_s:g} s (cluster.rendezvous_timeout_s)"
        )

    def _receive(self) -> None:
        try:
            while True:
                news = _call(lambda: self.board.newest.remote(self._version, POLL_S))
                if news is None:
                    continue
                version, nbytes, digest, (ref,) = news
                if digest != self.layout.digest or nbytes != self.layout.nbytes:
                    raise RuntimeError(
                        f"weight version {version} has layout {digest[:8]} of {nbytes} bytes; this "
                        f"replica expects {self.layout.digest[:8]} of {self.layout.nbytes} bytes"
                    )
                data = _call(lambda: ref, self.op_timeout_s)
                if data.nbytes != nbytes:
                    raise RuntimeError(f"weight version {version} arrived with {data.nbytes} of {nbytes} bytes")
                target = 1 - self.current
                with self.locks[target]:  # the unpublished half: no reader holds it
                    np.copyto(self.halves[target].numpy(), data)
                    self.held[target] = version
                del data
                with self._meta:
                    if version > self._version:
                        self.current, self._version = target, version
                    self._meta.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised in the generator by the next fetch
            with self._meta:
                self.error = exc
                self._meta.notify_all()
