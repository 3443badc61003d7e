"""The process rollout source: generator and environment actors, bounded by a staleness budget.
`pipeline.max_staleness = 0` is the synchronous loop on the same code path.

    generator process ──groups──> environment process ──scored groups──> trainer (this process)
          ^    (engine, admission)        (sandbox, env_workers threads)     (buffer, GRPO step)
          └──────────── SharedWeights (version v+1) <──── publish after each step ─────┘

The trainer process owns the run (loop.py RunLoop: the policy, the optimizer, evaluation on its
own engine copy, checkpoints and metrics); this source is its side of the pipeline. `take(t)`:
drain the inbound queue until the `StalenessBuffer` says step t's batch is ready (this wait is the
trainer's idle time), take it (checking each group's staleness <= max_staleness), tell the
generator what was dropped (so it backfills) and which stragglers to cut. `training()`, around
the GRPO step: lends the trainer the generator's idle threads, and with
`pipeline.admit_while_training` a helper thread admits the groups a replica's new version allows
the moment its `Loaded` arrives (every other message waits for the next take), so the generator
works on the next batch while the trainer trains. `publish`: one memory
copy into `SharedWeights`; the generator swaps them in between two decode steps without dropping
sequences in flight. In a LoRA run the state is the adapter tensors alone: the generators load
the frozen base from `generator_policy/` once and merge each version's adapters into it. The
actors are started and watched through a Placement (cluster/placement.py). Multi-turn tasks
(`multi_turn`): the environment process runs the episodes and sends each replica the turns to
sample on a queue of its own (episode_runner.py); groups are admitted, budgeted and filed
exactly as single-turn ones.

Guaranteed (tested): staleness of every trained group <= max_staleness, counted from its oldest
token's version; every admitted group is trained or dropped with a reason exactly once per run
segment (`groups.jsonl`, ledger.py), across crashes and resumes too; with max_staleness = 0 and
no oversampling, the batches, and so the weights, equal the reference synchronous loop's for the
same seed and thread counts. Every wait of the trainer is bounded: an actor that dies is an
`ActorFailed`, one that stops making progress a `PipelineStalled` with a diagnosis (cluster/watchdog.py).
Not guaranteed: bitwise reproducibility when max_staleness > 0 (which groups are ready at a step
depends on timing); a resumed run starts its pipeline afresh from the checkpoint's version (what
was in flight is `run_lost`, what was trained after the checkpoint `rolled_back`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from gapless.cluster.ipc import clean_leftover_ipc, name_ipc_objects
from gapless.cluster.names import replica_name
from gapless.cluster.placement import ActorExit, Placement
from gapless.cluster.watchdog import StallWatch
from gapless.config import Config, ConfigError
from gapless.envs.base import InfraUnavailable, Task
from gapless.errors import InfrastructureError, RunStopped
from gapless.orchestrate.actors import ActorSpec, _read_into, environment_main, generator_main
from gapless.orchestrate.admission import Admission, PromptSource
from gapless.orchestrate.buffer import StalenessBuffer
from gapless.orchestrate.dispatch import Dispatcher
from gapless.orchestrate.env_actors import EnvActors
from gapless.orchestrate.inbox import Inbox
from gapless.orchestrate.ledger import GroupLedger
from gapless.orchestrate.lending import LendingFlags, TrainerLending
from gapless.orchestrate.masking import MaskingWatch
from gapless.orchestrate.messages import Abort, ActorError, Assign, CancelScoring, GenStats, Loaded, Ready, Scored
from gapless.orchestrate.source import StepRollouts
from gapless.types import DropReason

SHUTDOWN_S = 10.0
FAILED_SHUTDOWN_S = 1.0  # after a failure or stall the actors' work is lost anyway: stop the run promptly
INBOX_MESSAGES = 4096  # bound of the trainer's inbound queue (records, scored groups, stats)


class ActorFailed(InfrastructureError):
    """A pipeline actor process raised or died; the message carries its traceback or exit code."""


class ResamplesExhausted(ConfigError):
    """Dynamic sampling dropped more zero-variance groups in one step than pipeline.max_resamples."""


def actor_threads(cfg: Config) -> dict[str, int]:
    """Threads the actors use at once: with a budget the generators and the trainer run together;
    at budget 0 the trainer takes turns with the generators (they wait for each step's weights)."""
    generators = {
        replica_name(r, cfg.cluster.replicas): cfg.pipeline.generator_threads_resolved
        for r in range(cfg.cluster.replicas)
    }
    if cfg.pipeline.max_staleness == 0:
        return generators if cfg.cluster.replicas > 1 else {}
    return {**generators, "trainer": cfg.pipeline.trainer_threads_resolved}


class _Evicted(Exception):
    """Raised inside a wait on a replica that was just evicted."""


@dataclass
class _Replica:
    slot: int
    name: str
    spec: ActorSpec
    alive: bool = True


class ProcessSource:
    eval_actor = "trainer"

    def __init__(
        self,
        cfg: Config,
        train: list[Task],
        policy,
        start_step: int,
        resume: bool,
        env_name: str,
        timelines,
        stop_requested,
        log=print,
        *,
        placement: Placement,
        trained_model=None,
        multi_turn: bool = False,
        max_seq_len: int,
        masking: MaskingWatch | None = None,
    ):
        """`policy`: the trainer's Policy (saved for the generators; its model may lend threads);
        `stop_requested()`: the name of a stop signal received, or None (checked in every wait);
        `trained_model`: the module the trainer runs when it is not `policy.model` (a LoRA run's
        peft model), where thread lending hooks its layers. `multi_turn`: the task's episodes run
        turn by turn (episode_runner.py), each replica sampling the turns the environment sends it;
        `max_seq_len`: the longest context a replica holds (an episode's, for multi-turn tasks);
        `placement`: where the actors run, already reserved (gapless.cluster.make_placement).
        `masking`: the run's masking watch (masking.py): it sees every scored group as it arrives,
        before the buffer files it."""
        self.multi_turn, self.max_seq_len = multi_turn, max_seq_len
        self.cfg, self.train, self.policy, self.log, self.timelines = cfg, train, policy, log, timelines
        self.env_name, self.stop_requested = env_name, stop_requested
        self.start_step, self.version = start_step, start_step
        self.run_dir = Path(cfg.run_dir)
        self.masking = masking or MaskingWatch(cfg.pipeline.max_infra_fraction, cfg.pipeline.on_infra_excess)
        self.placement = placement
        self.ctx = self.placement.ctx
        if removed := clean_leftover_ipc(self.run_dir):
            log(f"removed {removed} semaphores left in /dev/shm by a crashed run in {self.run_dir}")
        name_ipc_objects(self.run_dir)
        P, pl, R = cfg.loop.prompts_per_step, cfg.pipeline, cfg.cluster.replicas
        self.ledger = GroupLedger(self.run_dir / "groups.jsonl", resume_step=start_step if resume else None)
        self.buffer = StalenessBuffer(
            P, pl.max_staleness, pl.oversample > 0, self.ledger, pl.dynamic_sampling, [t.uid for t in train]
        )
        self.prompts = PromptSource(cfg.seed, [t.uid for t in train], P, pl.curriculum)
        self.admission = Admission(P, pl.max_staleness, pl.oversample, start_step)
        self.dispatcher = Dispatcher(self.admission, self.prompts)
        self.evictable = R > 1  # one replica stays today's pipeline: its death or stall ends the run
        self.slots = R + (cfg.cluster.replica_restarts if self.evictable else 0)
        self.names = [replica_name(slot, R) for slot in range(self.slots)]
        self.envs = EnvActors(cfg.cluster.env_actors, cfg.cluster.env_restarts)
        self.heartbeats = self.placement.heartbeats(("trainer", *self.envs.names, *self.names))
        self.heartbeats.register("trainer")
        self.watch = StallWatch(
            self.heartbeats, pl.stall_timeout_s, self.run_dir, (*self.names[:R], *self.envs.names[: self.envs.count])
        )
        self.max_resamples = pl.max_resamples or 8 * P
        self.step_resamples = 0  # zero-variance drops while assembling the current step
        self.drops_reported: dict[str, int] = {}  # buffer.drops at the last step's metrics
        self.assembling = start_step  # the step whose batch the buffer is filling
        self.staleness_counts: Counter[int] = Counter()
        self.gen_stats: list[dict] = []
        self.replicas: list[_Replica] = []
        self.actors: set[str] = set()  # the actors that must report Ready
        self.ready_actors: set[str] = set()
        self.started = False  # every actor of the first step was ready once
        self.inbox = Inbox()  # every actor's messages, forwarded by one reader thread each
        self.infra_since: float | None = None  # when groups started failing in the infrastructure (None: none failing)
        self.evictions: list[dict] = []  # replica, why, silent_s, step: written to staleness.json
        self.env_evictions: list[dict] = []  # environment, why, silent_s, step: likewise
        self._last_step_end: float | None = None
        self._step_started = 0.0
        self._publishing: _Replica | None = None
        self.lending: TrainerLending | None = None
        if pl.max_staleness > 0 and pl.lend_idle_cores and R == 1 and self.placement.kind == "local":
            self.lending = TrainerLending(
                LendingFlags(self.ctx),
                pl.trainer_threads_resolved,
                pl.generator_threads_resolved,
                pl.lend_while_scoring,
            )
            trained = trained_model.get_base_model() if trained_model is not None else policy.model
            if not self.lending.install(trained):
                self.lending = None  # no decoder layer list to hook: nothing to lend at
        self.admit_while_training = pl.admit_while_training_resolved(lending=self.lending is not None)

    # ---- the source protocol (source.py) --------------------------------------------------------
    def start(self, state, version: int) -> None:
        self.policy_dir = self.run_dir / "generator_policy"
        self.policy.save(self.policy_dir)  # architecture and tokenizer; the weights come through shared memory
        self.stop = self.placement.stop_flag()
        self.state, self.version = state, version  # what a restarted replica starts from
        # groups waiting to be scored, per replica: bounded (back-pressure) with one environment actor;
        # with several, admission alone bounds them (a lost actor's queues must not block a replica)
        place, bound = self.placement, 2 * self.cfg.loop.prompts_per_step if self.envs.slots == 1 else 0
        # to_env[e][r]: replica slot r's groups for environment slot e (one writer, one reader each)
        self.to_env = [[place.channel(bound) for _ in range(self.slots)] for _ in range(self.envs.slots)]
        # multi-turn: the environment sends each replica the turns to sample, on a queue of its own
        self.to_replica = [place.channel() for _ in range(self.slots)] if self.multi_turn else []
        for _ in range(self.envs.count):
            self._start_env()
        for slot in range(self.cfg.cluster.replicas):
            self._start_replica(slot, state, version)

    def take(self, step: int) -> StepRollouts:
        t0 = self._last_step_end or time.perf_counter()
        self.assembling, self.step_resamples = step, 0
        self.admission.assembling(step)
        self.watch.progressed()  # the trainer's own work since the last wait (train, eval, checkpoint) is no stall
        # the first step waits for every actor to start; a replica restarted after an eviction
        # starts while the others go on (the stall watch bounds its start-up by itself)
        if not self.started and not self.actors <= self.ready_actors:
            with self.timelines["trainer"].span("wait_actors_start"):  # spawn, imports, engine, sandbox
                while not self.actors <= self.ready_actors:
                    self._receive(0.05, "the generator and environment processes to start", starting=True)
            t0 = time.perf_counter()
        self.started = True
        self._check_alive()  # also when the buffer already holds the batch: a dead or stalled actor ends the run
        self.watch.check(f"step {step + 1}'s rollouts")
        wait_start = time.perf_counter()
        with self.timelines["trainer"].span("wait_rollouts", step=step):
            while not self.buffer.is_batch_ready(step):
                self._receive(0.05, f"step {step + 1}'s rollouts")
        waited = time.perf_counter() - wait_start
        drops_before = self.buffer.num_dropped
        groups, cut = self.buffer.take(step)
        if cut:
            self._abort(cut)
            for env in self.envs.live.values():
                env.inbox.put(CancelScoring(tuple(cut)))
        self.admission.freed(self.buffer.num_dropped - drops_before)  # stragglers and surplus free places to backfill,
        self.admission.assembling(step + 1)  # each born no earlier than the next step's weights allow
        self._assign()
        self.staleness_counts.update(step - r.completion.oldest_version for g in groups for r in g.rollouts)
        self._step_started = t0
        return StepRollouts(groups, t0, waited)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """While the trainer computes: the trainer borrows the generator's threads while it idles
        (lending.py); with `admit_while_training`, a helper thread handles the replicas' `Loaded`
        messages as they arrive (dispatcher and buffer are left to it: the trainer touches neither
        until the block ends) and keeps every other message, in order, for the next take."""
        admit = self.inbox.meanwhile(Loaded, self._loaded) if self.admit_while_training else contextlib.nullcontext()
        with admit, self.lending.borrowing() if self.lending else contextlib.nullcontext():
            yield

    def publish(self, state, version: int) -> dict[str, float]:
        pl, wait = self.cfg.pipeline, 0.0
        self.watch.progressed()  # a new wait: the trainer's step since the last one is no actor's silence
        for replica in [r for r in self.replicas if r.alive]:
            waiting_for = f"{replica.name} to release its weight buffer (publishing version {version})"
            timeout_s = self.cfg.cluster.op_timeout_s if self.evictable else pl.stall_timeout_s
            self._publishing = replica
            try:
                wait += replica.spec.weights.publish(
                    state, version, timeout_s, lambda: self._check_waiting(waiting_for)
                )
            except _Evicted:
                continue
            except TimeoutError:  # the publish waited the whole timeout
                if self._may_evict():
                    self._evict(replica, f"it held its weight buffer for {timeout_s:g} s (cluster.op_timeout_s)")
                    continue
                self.watch.stall(waiting_for, timeout_s, [replica.name])
            finally:
                self._publishing = None
        self.version, self.state = version, state
        self._last_step_end = time.perf_counter()
        return {"perf/weight_push_wait_s": wait}

    def stats(self) -> dict[str, float]:
        gen = self.gen_stats
        self.gen_stats = []
        gen_wall = sum(s["wall_s"] for s in gen)
        swaps = sum(s["swaps"] for s in gen)
        metrics = {}
        if self.evictable:
            metrics["cluster/replicas_live"] = float(sum(r.alive for r in self.replicas))
            metrics["cluster/evictions"] = float(len(self.evictions))
        if self.lending is not None:
            metrics["perf/trainer_borrowed_frac"] = (
                self.lending.borrowed_frac()
            )  # layer checks holding the generator's threads
        if gen_wall > 0:
            step_s = (self._last_step_end or time.perf_counter()) - self._step_started
            metrics.update(
                {
                    "perf/generator_idle_frac": sum(s["idle_s"] for s in gen) / gen_wall,
                    "perf/generator_blocked_frac": sum(s["blocked_s"] for s in gen) / gen_wall,
                    "perf/gen_tokens_per_s": sum(s["tokens"] for s in gen) / gen_wall,
                    "perf/generator_stall_s": sum(s["stall_s"] for s in gen) / max(swaps, 1),
                    "perf/generator_core_wait_frac": sum(s["core_wait_s"] for s in gen)
                    / gen_wall,  # waiting for lent threads
                    "perf/production_consumption_ratio": sum(s["groups"] for s in gen)
                    / gen_wall
                    * step_s
                    / self.cfg.loop.prompts_per_step,
                    "generator/running": float(gen[-1]["running"]),
                    "generator/waiting": float(gen[-1]["waiting"]),
                    "generator/partial_cuts": float(sum(s["partial_cuts"] for s in gen)),  # groups cut and requeued
                }
            )
        for reason, count in self.buffer.drops.items():
            metrics[f"drops/{reason}_total"] = float(count)  # since the start of this run segment
            metrics[f"drops/{reason}_step"] = float(
                count - self.drops_reported.get(reason, 0)
            )  # since the previous step
        self.drops_reported = dict(self.buffer.drops)
        return metrics

    def close(self, reason: str, version: int) -> None:
        self.buffer.close(version, reason)
        self.ledger.close()
        # always: a Ray placement also stops its cluster connection when no actor started
        self.placement.shutdown(
            getattr(self, "stop", None), SHUTDOWN_S if reason != "run_failed" else FAILED_SHUTDOWN_S
        )
        (self.run_dir / "staleness.json").write_text(
            json.dumps(
                {
                    "counts": {str(k): v for k, v in sorted(self.staleness_counts.items())},
                    "drops": self.buffer.drops,
                    "evictions": self.evictions,
                    "env_evictions": self.env_evictions,
                },
                indent=2,
            )
        )

    # ---- actors ---------------------------------------------------------------------------------
    def _spec(self, name: str, **fields) -> ActorSpec:
        prompts = [(task.uid, task.prompt) for task in self.train]
        return ActorSpec(
            self.cfg,
            name,
            prompts,
            self.policy_dir,
            os.getpid(),
            self.heartbeats,
            self.stop,
            outbox=self.placement.channel(INBOX_MESSAGES),
            **fields,
        )

    def _start(self, spec: ActorSpec, main) -> None:
        threading.Thread(
            target=_forward, args=(spec.name, spec.outbox, self.inbox), name=f"read-{spec.name}", daemon=True
        ).start()
        self.actors.add(spec.name)
        self.placement.start(spec.name, main, spec)

    def _start_replica(self, slot: int, state, version: int) -> None:
        name = self.names[slot]
        spec = self._spec(
            name,
            inbox=self.placement.channel(),
            replica=slot,
            weights=self.placement.weights(state, version),
            to_env=tuple(q[slot] for q in self.to_env),
            lending=self.lending.flags if self.lending else None,
            from_env=self.to_replica[slot] if self.multi_turn else None,
            max_seq_len=self.max_seq_len,
        )
        self.replicas.append(_Replica(slot, name, spec))
        self.heartbeats.starting(name)
        if name not in self.watch.actors:
            self.watch.actors.append(name)
        self._start(spec, generator_main)

    def _start_env(self) -> None:
        """An environment actor in the next free slot, reading every replica slot's queue for it."""
        slot = self.envs.started
        name = self.envs.names[slot]
        spec = self._spec(
            name,
            inbox=self.placement.channel(),
            from_generators=tuple(self.to_env[slot]),
            to_generators=tuple(self.to_replica),
            lending=self.lending.flags if self.lending else None,
        )
        self.envs.start(spec)
        self.heartbeats.starting(name)
        if name not in self.watch.actors:
            self.watch.actors.append(name)
        self._start(spec, environment_main)

    def _replica(self, slot: int) -> _Replica | None:
        return next((r for r in self.replicas if r.slot == slot and r.alive), None)

    def _assign(self) -> None:
        """Hand every group admission allows now to the replicas (dispatch.py)."""
        for slot, groups in self.dispatcher.assign().items():
            for index, task, born in groups:
                self.buffer.admitted(index, born, task)
            scorers = tuple(self.envs.route(index) for index, _, _ in groups)
            self._replica(slot).spec.inbox.put(Assign(tuple(groups), scorers if self.envs.evictable else ()))

    def _abort(self, indices: list[int]) -> None:
        by_replica: dict[int, list[int]] = {}
        for index in indices:
            slot = self.dispatcher.holder.get(index)
            self.dispatcher.scored(index)  # cut: no longer held
            if slot is not None:
                by_replica.setdefault(slot, []).append(index)
        for slot, held in by_replica.items():
            if (replica := self._replica(slot)) is not None:
                replica.spec.inbox.put(Abort(tuple(held)))

    def _may_evict(self) -> bool:
        live = sum(r.alive for r in self.replicas)
        return self.evictable and (live > 1 or len(self.replicas) < self.slots)

    def _evict(self, replica: _Replica, why: str, silent_s: float | None = None) -> None:
        """Take a dead or silent replica out of the run: kill it, end its groups as
        `replica_lost` (each frees a place for a backfill) and start a fresh replica if the
        run has restarts left."""
        self.placement.kill(replica.name)
        replica.alive = False
        self.evictions.append({"replica": replica.name, "why": why, "silent_s": silent_s, "step": self.assembling})
        self.watch.actors.remove(replica.name)
        self.actors.discard(replica.name)
        lost = [i for i in self.dispatcher.lost(replica.slot) if i not in self.buffer.closed]
        for index in lost:
            self.buffer.drop(index, DropReason.REPLICA_LOST, self.assembling)
        self.admission.freed(len(lost))
        restart = len(self.replicas) < self.slots
        self.log(
            f"warning: evicted {replica.name}: {why}; {len(lost)} groups end as replica_lost"
            + (f"; starting {self.names[len(self.replicas)]}" if restart else "")
        )
        if restart:
            self._start_replica(len(self.replicas), self.state, self.version)
        self._assign()
        if replica is self._publishing:
            raise _Evicted(replica.name)

    def _evict_env(self, slot: int, why: str, silent_s: float | None = None) -> None:
        """Take a dead or silent environment actor out of the run: kill it, end the groups routed
        to it as `env_lost` (those still generating are aborted on their replicas; each frees a
        place for a backfill) and start a fresh one if the run has restarts left."""
        name = self.envs.names[slot]
        self.placement.kill(name)
        self.env_evictions.append({"environment": name, "why": why, "silent_s": silent_s, "step": self.assembling})
        self.watch.actors.remove(name)
        self.actors.discard(name)
        lost = [i for i in self.envs.lost(slot) if i not in self.buffer.closed]
        self._abort(lost)
        for index in lost:
            self.buffer.drop(index, DropReason.ENV_LOST, self.assembling)
        self.admission.freed(len(lost))
        restart = self.envs.has_spare()
        self.log(
            f"warning: evicted {name}: {why}; {len(lost)} groups end as env_lost"
            + (f"; starting {self.envs.names[self.envs.started]}" if restart else "")
        )
        if restart:
            self._start_env()
        self._assign()

    def _check_evictable(self) -> None:
        """Evict replicas and environment actors that died or went silent for cluster.op_timeout_s
        (where the run has 2 or more of them); the last one of a kind is left to _check_alive."""
        if not (self.evictable or self.envs.evictable):
            return
        exits = {gone.name: gone for gone in self.placement.exited()}
        replicas = [r for r in self.replicas if r.alive] if self.evictable else []
        for replica in replicas:
            if not self._may_evict():
                break
            if (lost := self._why_lost(replica.name, exits)) is not None:
                self._evict(replica, *lost)
        envs = list(self.envs.live.items()) if self.envs.evictable else []
        for slot, spec in envs:
            if len(self.envs.live) == 1 and not self.envs.has_spare():
                break
            if (lost := self._why_lost(spec.name, exits)) is not None:
                self._evict_env(slot, *lost)

    def _why_lost(self, name: str, exits: dict[str, ActorExit]) -> tuple[str, float | None] | None:
        """(why, seconds silent) when the actor `name` exited or went silent past the op timeout."""
        if name in exits:
            return f"it {exits[name].why or f'exited with code {exits[name].exitcode}'}", None
        if name in self.ready_actors and (silent := self.heartbeats.age_s(name)) > self.cfg.cluster.op_timeout_s:
            return f"no heartbeat for {silent:.1f} s (cluster.op_timeout_s)", silent
        return None

    # ---- waits ---------------------------------------------------------------------------------
    def _receive(self, timeout: float, waiting_for: str, starting: bool = False) -> None:
        """Take one message from the actors (or time out); every wait of the trainer runs through
        here, so each is bounded by the liveness and stall checks."""
        self.heartbeats.beat("trainer")
        if signal_name := self.stop_requested():
            raise RunStopped(signal_name)
        self._check_evictable()
        try:
            message = self.inbox.get(timeout=timeout)
        except queue.Empty:
            self._check_alive()
            self.watch.check(waiting_for, starting)
            return
        self.watch.check(waiting_for, starting)  # also while groups still arrive: a stalled actor ends the run now
        if isinstance(message, Loaded):
            self._loaded(message)
        elif isinstance(message, Scored):
            self.watch.progressed()
            group = message.group
            observed = self.masking.observe(self.train[group.task_index].uid, list(group.rollouts))
            group = dataclasses.replace(group, rollouts=tuple(observed))  # a flagged prompt's masked ones scored
            self.dispatcher.scored(group.index)
            self.envs.scored(group.index)
            self.prompts.feedback(
                self.train[group.task_index].uid, [r.reward for r in group.rollouts if not r.is_infra_failure]
            )
            self._file(group)
            if message.gen_stats is not None:
                self.gen_stats.append(message.gen_stats.stats)
        elif isinstance(message, Ready):
            self.ready_actors.add(message.actor)
            self.envs.mark_ready(message.actor)
            self.watch.progressed()
        elif isinstance(message, GenStats):
            self.gen_stats.append(message.stats)
        elif isinstance(message, ActorError):
            if message.actor in self.actors:  # not an evicted actor's last words
                raise ActorFailed(f"the {message.actor} process failed:\n{message.traceback}")

    def _loaded(self, message: Loaded) -> None:
        if self._replica(message.replica) is not None:  # not from an evicted replica
            self.dispatcher.loaded(message.replica, message.version)
            self._assign()

    def _file(self, group) -> None:
        reason = self.buffer.arrived(group)
        if reason != "infra_error":
            self.infra_since = None  # something was scored: not an outage
        if reason is None:
            return
        # a backfill born now is due at step born + budget: the dispatcher's guard keeps it from being due too early
        self.admission.freed(1)
        self._assign()
        if reason == "infra_error":
            now = time.monotonic()
            self.infra_since = self.infra_since or now
            if now - self.infra_since >= self.cfg.pipeline.outage_s:
                detail = group.rollouts[0].info.get("error", "")
                raise InfraUnavailable(
                    f"every group failed to be scored for {now - self.infra_since:.0f} s (pipeline.outage_s), each after "
                    f"{self.cfg.pipeline.infra_retries} retries, in environment {self.env_name!r}: {detail}; "
                    "fix the environment's infrastructure (`gapless sandbox check` for the sandbox)"
                )
        if reason == "zero_variance":
            self.step_resamples += 1
            if self.step_resamples == self.max_resamples // 2:
                self.log(
                    f"warning: dynamic sampling dropped {self.step_resamples} zero-variance groups for step "
                    f"{self.assembling + 1} (stops at pipeline.max_resamples = {self.max_resamples})"
                )
            if self.step_resamples >= self.max_resamples:
                raise ResamplesExhausted(
                    f"pipeline.dynamic_sampling dropped {self.step_resamples} groups for step {self.assembling + 1}, all with "
                    f"equal rewards (pipeline.max_resamples = {self.max_resamples}): the prompts are always or never solved; "
                    "use pipeline.curriculum = 'pass_rate', other data, or set pipeline.dynamic_sampling = false"
                )

    def _check_waiting(self, waiting_for: str) -> None:
        self._check_alive()  # a reader killed while holding the buffer is dead, not stalled
        self.watch.check(waiting_for)

    def _check_alive(self) -> None:
        self._check_evictable()
        for gone in self.placement.exited():
            if gone.why:
                raise ActorFailed(f"gapless-{gone.name} {gone.why}; the last checkpoint is intact for --resume")
            raise ActorFailed(
                f"gapless-{gone.name} exited with code {gone.exitcode} without reporting an error "
                "(killed by the OOM killer or a signal?); see the system log"
            )


def _forward(name: str, source, sink: Inbox) -> None:
    """The actor `name`'s outbox into the trainer's inbox (actors._read_into). A read that fails (a
    message this process cannot unpickle, a mailbox that died) arrives as that actor's ActorError: the
    run fails saying so, instead of waiting for the stall watch."""
    _read_into(
        source,
        sink,
        lambda exc: ActorError(
            name,
            str(exc)
            if isinstance(exc, InfrastructureError)
            else f"the trainer could not read a message from {name}:\n{traceback.format_exc()}",
        ),
    )
