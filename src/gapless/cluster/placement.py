"""Placement: where the pipeline's actors run and how the trainer talks to them.

The process source (pipeline.py) starts its generator and environment actors, opens its queues
and watches its actors' liveness only through a `Placement`; the actor code (actors.py) does not
know which placement it runs under, only that its queues, stop flag, heartbeats and weight buffer
come from the placement's factories (`channel`, `stop_flag`, `heartbeats`, `weights`):

    LocalPlacement   spawned processes on this machine, multiprocessing queues, and shared memory
                     for the weights, heartbeats and the stop flag (`ctx`); never imports Ray.
    RayPlacement     Ray actors in a placement group on a Ray cluster's nodes, with batched
                     channels and an object-store weight relay (cluster/ray/placement.py; imported only
                     by `gapless.cluster.make_placement` when cluster.placement = 'ray').

Each placement also says where the trainer's data-parallel ranks 1..W-1 run (`trainer_ranks`):
local processes, or Ray actors on bundles of the same placement group.

Guaranteed by every placement: `reserve` fails before anything starts, with an error naming the
demand and what is available; every actor it starts dies with the trainer process (even a
SIGKILLed one); `exited()` reports an actor that died without a word, with its exit code;
`shutdown` stops every actor within its grace period and kills what is left. Not guaranteed:
channels are FIFO per producer only (two producers' records interleave in arrival order).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from gapless.config import ConfigError, usable_cores


class PlacementError(ConfigError):
    """The actors' demand does not fit what the machine (or cluster) offers."""


@dataclass(frozen=True)
class ActorExit:
    name: str
    exitcode: int | None  # None: it is gone but its code is unknown
    why: str = ""  # what the placement knows of the death, completing "gapless-NAME ..." (Ray: cluster/ray/deaths.py)


@runtime_checkable
class Placement(Protocol):
    kind: str
    ctx: Any  # the multiprocessing context the actors' shared-memory objects are made with

    def reserve(self, threads: dict[str, int]) -> str | None:
        """Check that actors using these thread counts at once fit: PlacementError when one actor
        alone needs more than there is; a warning (returned) when together they share cores."""

    def channel(self, maxsize: int = 0) -> Any:
        """A queue to or from the actors (put/get with timeouts, queue.Full/queue.Empty); one
        writer and one reader each."""

    def stop_flag(self) -> Any:
        """The run's stop request (watchdog.StopFlag's set / is_set / wait), readable by every actor."""

    def heartbeats(self, actors: tuple[str, ...]) -> Any:
        """watchdog.Heartbeats for these actor names (beat in the actors, age_s in the trainer)."""

    def weights(self, state: dict, version: int) -> Any:
        """One replica's weight buffer holding `state` as `version`: SharedWeights' publish (trainer)
        and fetch_into (replica)."""

    def start(self, name: str, main: Callable[[Any], None], spec: Any) -> None:
        """Run `main(spec)` as the actor `name`, dying with the trainer."""

    def exited(self) -> list[ActorExit]:
        """Actors started here that are no longer running (and were not killed by `kill`)."""

    def kill(self, name: str) -> None:
        """Kill the actor `name` now and forget it (an evicted replica)."""

    def shutdown(self, stop: Any, grace_s: float) -> None:
        """Set `stop`, wait up to `grace_s` for every actor, then kill what is left."""

    def trainer_ranks(self) -> Any:
        """cluster/ranks.RankHosts for the trainer's data-parallel ranks 1..W-1 (after `reserve`)."""


class LocalPlacement:
    kind = "local"

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.processes: dict[str, Any] = {}

    def reserve(self, threads: dict[str, int]) -> str | None:
        cores = usable_cores()
        for name, n in threads.items():
            if n > max(cores, 2):
                raise PlacementError(
                    f"the {name} needs {n} threads but {cores} cores are available; lower its threads "
                    "(pipeline.generator_threads / pipeline.trainer_threads; 0 = split the cores)"
                )
        used = sum(threads.values())
        if used > max(cores, 2):
            detail = " + ".join(f"{n} ({name})" for name, n in threads.items())
            return f"the actors run {detail} = {used} threads at once on {cores} cores: they will share cores"
        return None

    def channel(self, maxsize: int = 0):
        return self.ctx.Queue(maxsize)

    def stop_flag(self):
        from gapless.cluster.watchdog import StopFlag

        return StopFlag(self.ctx)

    def heartbeats(self, actors: tuple[str, ...]):
        from gapless.cluster.watchdog import Heartbeats

        return Heartbeats(self.ctx, actors)

    def weights(self, state: dict, version: int):
        from gapless.cluster.weights import SharedWeights

        return SharedWeights(state, version, self.ctx)

    def start(self, name: str, main: Callable[[Any], None], spec: Any) -> None:
        # actors.py's start-up asks the kernel to kill each actor when the trainer dies (PR_SET_PDEATHSIG)
        process = self.ctx.Process(target=main, args=(spec,), name=f"gapless-{name}", daemon=True)
        with _environ(engine_environ(name, getattr(spec, "cfg", None))):  # a spawned child reads it at start
            process.start()
        self.processes[name] = process

    def exited(self) -> list[ActorExit]:
        return [ActorExit(name, p.exitcode) for name, p in self.processes.items() if not p.is_alive()]

    def kill(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            process.kill()
            process.join(timeout=5)

    def shutdown(self, stop, grace_s: float) -> None:
        if not self.processes:
            return
        stop.set()
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = {}

    def trainer_ranks(self):
        from gapless.cluster.ranks import LocalRanks

        return LocalRanks()


ENGINE_WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}


def engine_environ(name: str, cfg) -> dict[str, str]:
    """What a generator replica's process adds to its environment (local or Ray placement):
    `engine_wait_policy()`. Nothing for another actor (the trainer keeps OpenMP's default)."""
    if not name.startswith("generator") or cfg is None:
        return {}
    return engine_wait_policy()


def engine_wait_policy() -> dict[str, str]:
    """What a process whose work is an engine's (a generator replica, `gapless serve`, `gapless eval`,
    `gapless serve-training`) adds to its environment before torch loads OpenMP: threads that
    sleep at a barrier instead of spinning. A torch-engine decode step is ~50 parallel regions,
    vLLM-CPU's as many; where other processes share the cores, a spinning thread burns the time
    slice its preempted sibling needs, and a step takes 10-100x longer (docs/engine.md, *Threads
    on a shared machine*). Nothing where the user set OpenMP's wait policy or spin count."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return dict(ENGINE_WAIT_POLICY)


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """`extra` in os.environ for the block (what a process spawned in it inherits)."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
