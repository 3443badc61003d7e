"""Sampling engines of the Tinker service: one `Scheduler` per set of weights being sampled.

A key names the weights: a base model's name, or the `tinker://.../sampler_weights/...` path a
training client saved with `save_weights_for_sampler`. Every request on one key joins that key's
scheduler, so requests of all clients on the same weights share one continuous batch (the
scheduler of `gapless serve`). Engines are made on first use, at most `max_engines` of them;
past that the least recently used idle snapshot engine takes the new weights (`update_weights`,
between two of its steps) instead of allocating another KV cache. A base model's engine keeps its
weights for the life of the service: the OpenAI routes (service/server.py) submit to it directly,
so OpenAI and Tinker requests on the base model share one continuous batch.

    route ── submit(key, request) ──> [lock: pick/re-key a scheduler, scheduler.submit] ──> handle
    route ── scorer(key) ──> an HF module with the key's weights (prompt log-probs, compute_logprobs)

With the vLLM engine (`engine="vllm"`: one vLLM engine per process, which sizes its cache from
the memory it finds) there is one engine for one base model, and every key takes turns on it: a
request on other weights than the engine holds re-keys it when it is idle, and is refused with
`QueueFull` (HTTP 429, which the SDK and the OpenAI client back off on and retry) while requests
on the current weights are in flight. The OpenAI routes then submit through `pinned(base)`, so
they too get the base's weights, never a snapshot's.

Guaranteed: a request is submitted under the same lock that re-keys engines, so it never runs on
weights other than its key's; the `max_snapshots` most recently saved or sampled snapshots stay
registered (in memory, full HF-named weights each), older ones are dropped and sampling them is a
user error that says to save them again (an RL loop saves one per step: without the bound memory
would grow by a model per step). Not guaranteed: one batch across different weights (no
multi-LoRA batching: requests on different snapshots run in different engines), fairness between
keys on the vLLM engine (a key with requests always in flight keeps it), or any snapshot after a
restart (`save_state` checkpoints are the durable ones).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from gapless.generate import serving_engine
from gapless.serve.protocol import QueueFull, SampleRequest
from gapless.serve.scheduler import RequestHandle, Scheduler
from gapless.serve.scoring import Scorer
from gapless.service.models import BaseModel, BaseModels, UserError


class SamplerPool:
    def __init__(
        self,
        bases: BaseModels,
        *,
        max_engines: int = 4,
        max_batch: int = 64,
        max_samples: int = 1024,
        max_snapshots: int = 16,
        engine: str = "torch",
        work_dir: str | Path = "runs/service",
        prefix_cache_mb: int = 0,
    ):
        """`engine`: 'torch' or 'vllm' (one engine in all, `max_engines` aside); `work_dir`: where
        vLLM's copy of a base model is written; `prefix_cache_mb`: each torch engine's prefix cache."""
        if engine == "vllm":
            max_engines = 1
        self.engine, self.work_dir = engine, Path(work_dir)
        self.bases, self.max_engines, self.max_snapshots = bases, max_engines, max_snapshots
        self.max_batch, self.max_samples = max_batch, max_samples
        self.prefix_cache_mb = prefix_cache_mb
        self._snapshots: OrderedDict[str, tuple[str, dict[str, torch.Tensor]]] = (
            OrderedDict()
        )  # path -> (base, weights)
        self._dropped: set[str] = set()
        self._engines: OrderedDict[str, Scheduler] = OrderedDict()  # key -> scheduler, least recent first
        self._bases_of: dict[int, str] = {}  # id(scheduler) -> base name it was built for
        self._scorers: OrderedDict[str, Scorer] = OrderedDict()
        self._lock = threading.Lock()
        self._versions = 0

    def register(self, path: str, base_name: str, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._snapshots[path] = (base_name, state)
            self._snapshots.move_to_end(path)
            self._dropped.discard(path)
            while len(self._snapshots) > self.max_snapshots:
                old, _ = self._snapshots.popitem(last=False)
                self._dropped.add(old)
                self._scorers.pop(old, None)

    def holds(self, path: str) -> bool:
        """Whether the snapshot saved at `path` is still registered."""
        return path in self._snapshots

    def drop(self, path: str) -> None:
        """Forget the snapshot at `path` (a deleted checkpoint); sampling it is then a user error."""
        with self._lock:
            self._snapshots.pop(path, None)
            self._scorers.pop(path, None)

    def copy(self, source: str, destination: str) -> None:
        """Register `source`'s weights under `destination` too (copy_weights: the tensors are shared)."""
        if source not in self._snapshots:
            raise UserError(f"no sampler weights at {source!r}")
        self.register(destination, *self._snapshots[source])

    def base_of(self, key: str) -> BaseModel:
        """The base model behind `key` (UserError if the key names nothing served)."""
        if (snapshot := self._snapshots.get(key)) is not None:
            return self.bases.get(snapshot[0])
        if key in self._dropped:
            raise UserError(
                f"the sampler weights at {key!r} were dropped: the service keeps the {self.max_snapshots} "
                "most recently used snapshots (service.max_snapshots); save them again"
            )
        if key.startswith("tinker://"):
            raise UserError(f"no sampler weights at {key!r}: save them first with save_weights_for_sampler")
        return self.bases.get(key)

    def scheduler_for(self, key: str) -> Scheduler:
        """The scheduler serving `key` (built if needed); a base model's keeps its weights for good."""
        base = self.base_of(key)
        with self._lock:
            return self._scheduler(key, base)

    def pinned(self, key: str) -> Scheduler | PinnedScheduler:
        """What the OpenAI routes submit to for `key`: a base model's own scheduler with the torch
        engine (it keeps its weights for good); else a view whose submits go through
        `submit(key, ...)`, since the engine serving a sampler path may be evicted, and the one
        vLLM engine may hold another key's weights between two requests."""
        base = self.base_of(key)
        with self._lock:
            if self.engine == "vllm" and self._engines:  # the one engine: submit re-keys it when idle
                scheduler = next(iter(self._engines.values()))
            else:
                scheduler = self._scheduler(key, base)
        if self.engine == "torch" and not key.startswith("tinker://"):
            return scheduler
        return PinnedScheduler(self, key, scheduler)

    def submit(self, key: str, request: SampleRequest) -> RequestHandle:
        """Queue `request` on the scheduler serving `key`'s weights (building or re-keying one)."""
        base = self.base_of(key)
        with self._lock:
            scheduler = self._scheduler(key, base)
            return scheduler.submit(request)

    def _scheduler(self, key: str, base: BaseModel) -> Scheduler:
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
        elif key.startswith("tinker://"):  # dropped between base_of and here
            raise UserError(f"the sampler weights at {key!r} were dropped; save them again")
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        state = self._snapshots[key][1] if key in self._snapshots else base.policy.model.state_dict()
        if self.engine == "vllm" and self._engines:
            return self._rekey_vllm(key, state)
        self._versions += 1
        if len(self._engines) >= self.max_engines:
            for (
                old_key,
                old,
            ) in self._engines.items():  # base-model engines keep their weights (the OpenAI routes hold one)
                if (
                    old_key.startswith("tinker://")
                    and self._bases_of[id(old)] == base.name
                    and old.samples_in_flight == 0
                ):
                    del self._engines[old_key]
                    old.update_weights(state, self._versions)  # applied before any later submit
                    self._engines[key] = old
                    return old
        engine = serving_engine(
            self.engine,
            base.policy,
            max_batch=self.max_batch,
            max_seq_len=base.context,
            model_dir=self.work_dir / "vllm" / base.name,
            save=True,  # this process's base weights, never an earlier run's copy
            prefix_cache_mb=self.prefix_cache_mb,
        )
        if key in self._snapshots:
            engine.update_weights(state, self._versions)
        scheduler = Scheduler(
            engine, base.policy.decode, max_samples=self.max_samples, name=f"tinker-sampler-{len(self._bases_of)}"
        )
        self._bases_of[id(scheduler)] = base.name
        self._engines[key] = scheduler
        return scheduler

    def _rekey_vllm(self, key: str, state: dict[str, torch.Tensor]) -> Scheduler:
        """The one vLLM engine takes `key`'s weights if it is idle; else a 429 with the reason."""
        ((held, scheduler),) = self._engines.items()
        if scheduler.samples_in_flight:
            raise QueueFull(
                f"the vLLM sampling engine holds requests on other weights ({held}) and serves one set of "
                "weights at a time; retry when they finish"
            )
        self._versions += 1
        scheduler.update_weights(state, self._versions)  # applied before any later submit
        self._engines.clear()
        self._engines[key] = scheduler
        return scheduler

    def scorer(self, key: str) -> Scorer:
        base = self.base_of(key)
        with self._lock:
            if key in self._scorers:
                self._scorers.move_to_end(key)
                return self._scorers[key]
            if key.startswith("tinker://"):
                if key not in self._snapshots:
                    raise UserError(f"the sampler weights at {key!r} were dropped; save them again")
                model = copy.deepcopy(base.policy.model)
                model.load_state_dict(self._snapshots[key][1], strict=False)  # a tied LM head may be absent
            else:
                model = base.policy.model
            self._scorers[key] = Scorer(model)
            while len(self._scorers) > self.max_engines:
                self._scorers.popitem(last=False)
            return self._scorers[key]

    def close(self) -> None:
        with self._lock:
            schedulers = list(dict.fromkeys(self._engines.values()))
            self._engines.clear()
        for scheduler in schedulers:
            scheduler.close()

    @property
    def schedulers(self) -> list[Scheduler]:
        return list(self._engines.values())


class PinnedScheduler:
    """A scheduler as the OpenAI routes use it, whose submits go to one key's weights through the
    pool (the vLLM engine may hold another key's between two requests)."""

    def __init__(self, pool: SamplerPool, key: str, scheduler: Scheduler):
        self.pool, self.key, self._scheduler = pool, key, scheduler

    def submit(self, request: SampleRequest) -> RequestHandle:
        return self.pool.submit(self.key, request)

    def __getattr__(self, name: str):  # engine, max_seq_len, stats, close: the one scheduler's
        return getattr(self._scheduler, name)
