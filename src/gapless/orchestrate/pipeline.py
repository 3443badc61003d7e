"""The process rollout source: generator and environment actors, bounded by a staleness budget.
`pipeline.max_staleness = 0` is the synchronous loop on the same code path.

    generator process ──groups──> environment process ──scored groups──> trainer (this process)
          ^    (engine, admission)        (sandbox, env_workers threads)     (buffer, GRPO step)
          └──────────── SharedWeights (version v+1) <──── publish after each step ─────┘

The trainer process owns the run (loop.py RunLoop: the policy, the optimizer, evaluation on its
own engine copy, checkpoints and metrics); this source is its side of the pipeline. `take(t)`:
drain the inbound queue until the `StalenessBuffer` says step t's batch is ready (this wait is the
trainer's idle time), take it (checking each group's staleness <= max_staleness), tell the
generator what was dropped (so it backfills) and which stragglers to cut. `publish`: one memory
copy into `SharedWeights`; the generator swaps them in between two decode steps without dropping
sequences in flight. The actors are started and watched through a Placement (placement.py).

Guaranteed (tested): staleness of every trained group <= max_staleness, counted from its oldest
token's version; every admitted group is trained or dropped with a reason exactly once per run
segment (`groups.jsonl`, ledger.py), across crashes and resumes too; with max_staleness = 0 and
no oversampling, the batches, and so the weights, equal the reference synchronous loop's for the
same seed and thread counts. Every wait of the trainer is bounded: an actor that dies is an
`ActorFailed`, one that stops making progress a `PipelineStalled` with a diagnosis (watchdog.py).
Not guaranteed: bitwise reproducibility when max_staleness > 0 (which groups are ready at a step
depends on timing); a resumed run starts its pipeline afresh from the checkpoint's version (what
was in flight is `run_lost`, what was trained after the checkpoint `rolled_back`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import time
from collections import Counter
from pathlib import Path

from gapless.config import Config, ConfigError
from gapless.envs.base import InfraUnavailable, Task
from gapless.errors import InfrastructureError, RunStopped
from gapless.orchestrate.actors import ActorSpec, environment_main, generator_main
from gapless.orchestrate.buffer import StalenessBuffer
from gapless.orchestrate.ipc import clean_leftover_ipc, name_ipc_objects
from gapless.orchestrate.ledger import GroupLedger
from gapless.orchestrate.lending import LendingFlags, TrainerLending
from gapless.orchestrate.messages import (Abort, ActorError, Admitted, CancelScoring, Dropped, GenStats, Ready, Scored)
from gapless.orchestrate.placement import LocalPlacement, Placement
from gapless.orchestrate.source import StepRollouts
from gapless.orchestrate.watchdog import Heartbeats, StallWatch
from gapless.orchestrate.weights import SharedWeights

SHUTDOWN_S = 10.0
FAILED_SHUTDOWN_S = 1.0  # after a failure or stall the actors' work is lost anyway: stop the run promptly
INBOX_MESSAGES = 4096  # bound of the trainer's inbound queue (records, scored groups, stats)


class ActorFailed(InfrastructureError):
    """A pipeline actor process raised or died; the message carries its traceback or exit code."""


class ResamplesExhausted(ConfigError):
    """Dynamic sampling dropped more zero-variance groups in one step than pipeline.max_resamples."""


def actor_threads(cfg: Config) -> dict[str, int]:
    """Threads the actors use at once: with a budget the generator and the trainer run together,
    so their threads must fit the cores; at budget 0 they take turns (the generator waits for each
    step's weights), so each may use every core."""
    if cfg.pipeline.max_staleness == 0:
        return {}
    return {"generator": cfg.pipeline.generator_threads_resolved, "trainer": cfg.pipeline.trainer_threads_resolved}


class ProcessSource:
    eval_actor = "trainer"

    def __init__(self, cfg: Config, train: list[Task], policy, start_step: int, resume: bool, env_name: str,
                 timelines, stop_requested, log=print, placement: Placement | None = None):
        """`policy`: the trainer's Policy (saved for the generator; its model may lend threads);
        `stop_requested()`: the name of a stop signal received, or None (checked in every wait)."""
        self.cfg, self.train, self.policy, self.log, self.timelines = cfg, train, policy, log, timelines
        self.env_name, self.stop_requested = env_name, stop_requested
        self.start_step, self.version = start_step, start_step
        self.run_dir = Path(cfg.run_dir)
        self.placement = placement or LocalPlacement()
        self.placement.reserve(actor_threads(cfg))
        self.ctx = self.placement.ctx
        if (removed := clean_leftover_ipc(self.run_dir)):
            log(f"removed {removed} semaphores left in /dev/shm by a crashed run in {self.run_dir}")
        name_ipc_objects(self.run_dir)
        self.ledger = GroupLedger(self.run_dir / "groups.jsonl", resume_step=start_step if resume else None)
        self.buffer = StalenessBuffer(cfg.loop.prompts_per_step, cfg.pipeline.max_staleness, cfg.pipeline.oversample > 0,
                                      self.ledger, cfg.pipeline.dynamic_sampling, [t.uid for t in train])
        self.heartbeats = Heartbeats(self.ctx)
        self.heartbeats.register("trainer")
        self.watch = StallWatch(self.heartbeats, cfg.pipeline.stall_timeout_s, self.run_dir, ("generator", "environment"))
        self.max_resamples = cfg.pipeline.max_resamples or 8 * cfg.loop.prompts_per_step
        self.step_resamples = 0  # zero-variance drops while assembling the current step
        self.drops_reported: dict[str, int] = {}  # buffer.drops at the last step's metrics
        self.assembling = start_step  # the step whose batch the buffer is filling
        self.staleness_counts: Counter[int] = Counter()
        self.gen_stats: list[dict] = []
        self.actors: tuple[str, ...] = ()
        self.ready_actors: set[str] = set()
        self.infra_since: float | None = None  # when groups started failing in the infrastructure (None: none failing)
        self._last_step_end: float | None = None
        self._push_wait_s = 0.0
        self._step_started = 0.0
        self.spec: ActorSpec | None = None
        self.lending: TrainerLending | None = None
        pl = cfg.pipeline
        if pl.max_staleness > 0 and pl.lend_idle_cores:
            self.lending = TrainerLending(LendingFlags(self.ctx), pl.trainer_threads_resolved, pl.generator_threads_resolved)
            if not self.lending.install(policy.model):
                self.lending = None  # no decoder layer list to hook: nothing to lend at

    # ---- the source protocol (source.py) --------------------------------------------------------
    def start(self, state, version: int) -> None:
        policy_dir = self.run_dir / "generator_policy"
        self.policy.save(policy_dir)  # architecture and tokenizer; the weights come through shared memory
        self.weights = SharedWeights(state, version, self.ctx)
        bound = 2 * self.cfg.loop.prompts_per_step  # groups waiting to be scored
        prompts = [(task.uid, task.prompt) for task in self.train]
        place = self.placement
        self.spec = ActorSpec(self.cfg, prompts, policy_dir, self.start_step, self.weights, place.channel(bound),
                              place.channel(INBOX_MESSAGES), place.channel(), place.channel(), place.event(),
                              os.getpid(), self.heartbeats, self.lending.flags if self.lending else None)
        self.actors = ("generator", "environment")
        for name, main in (("generator", generator_main), ("environment", environment_main)):
            place.start(name, main, self.spec)

    def take(self, step: int) -> StepRollouts:
        t0 = self._last_step_end or time.perf_counter()
        self.assembling, self.step_resamples = step, 0
        self.watch.progressed()  # the trainer's own work since the last wait (train, eval, checkpoint) is no stall
        if len(self.ready_actors) < len(self.actors):
            with self.timelines["trainer"].span("wait_actors_start"):  # spawn, imports, engine, sandbox
                while len(self.ready_actors) < len(self.actors):
                    self._receive(0.05, "the generator and environment processes to start", starting=True)
            t0 = time.perf_counter()
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
            self.spec.to_generator.put(Abort(tuple(cut)))
            self.spec.env_control.put(CancelScoring(tuple(cut)))
        freed = self.buffer.num_dropped - drops_before  # stragglers and surplus free places to backfill,
        if freed:  # each born no earlier than this step's weights allow
            self.spec.to_generator.put(Dropped(freed, step + 1 - self.cfg.pipeline.max_staleness))
        self.staleness_counts.update(step - r.completion.oldest_version for g in groups for r in g.rollouts)
        self._step_started = t0
        return StepRollouts([list(g.rollouts) for g in groups], t0, waited)

    def lend_threads(self):
        return self.lending.borrowing() if self.lending else contextlib.nullcontext()

    def publish(self, state, version: int) -> dict[str, float]:
        waiting_for = f"the generator to release the weight buffer (publishing version {version})"
        timeout_s = self.cfg.pipeline.stall_timeout_s
        try:
            self._push_wait_s = self.weights.publish(state, version, timeout_s, lambda: self._check_waiting(waiting_for))
        except TimeoutError:  # the publish waited the whole stall timeout
            self.watch.stall(waiting_for, timeout_s, ["generator"])
        self.version = version
        self._last_step_end = time.perf_counter()
        return {"perf/weight_push_wait_s": self._push_wait_s}

    def stats(self) -> dict[str, float]:
        gen = self.gen_stats
        self.gen_stats = []
        gen_wall = sum(s["wall_s"] for s in gen)
        swaps = sum(s["swaps"] for s in gen)
        metrics = {}
        if self.lending is not None:
            metrics["perf/trainer_borrowed_frac"] = self.lending.borrowed_frac()  # layer checks holding the generator's threads
        if gen_wall > 0:
            step_s = (self._last_step_end or time.perf_counter()) - self._step_started
            metrics.update({
                "perf/generator_idle_frac": sum(s["idle_s"] for s in gen) / gen_wall,
                "perf/generator_blocked_frac": sum(s["blocked_s"] for s in gen) / gen_wall,
                "perf/gen_tokens_per_s": sum(s["tokens"] for s in gen) / gen_wall,
                "perf/generator_stall_s": sum(s["stall_s"] for s in gen) / max(swaps, 1),
                "perf/generator_core_wait_frac": sum(s["core_wait_s"] for s in gen) / gen_wall,  # waiting for lent threads
                "perf/production_consumption_ratio": sum(s["groups"] for s in gen) / gen_wall * step_s / self.cfg.loop.prompts_per_step,
                "generator/running": float(gen[-1]["running"]),
                "generator/waiting": float(gen[-1]["waiting"]),
                "generator/partial_cuts": float(sum(s["partial_cuts"] for s in gen)),  # groups cut and requeued
            })
        for reason, count in self.buffer.drops.items():
            metrics[f"drops/{reason}_total"] = float(count)  # since the start of this run segment
            metrics[f"drops/{reason}_step"] = float(count - self.drops_reported.get(reason, 0))  # since the previous step
        self.drops_reported = dict(self.buffer.drops)
        return metrics

    def close(self, reason: str, version: int) -> None:
        self.buffer.close(version, reason)
        self.ledger.close()
        if self.spec is not None:
            self.placement.shutdown(self.spec.stop, SHUTDOWN_S if reason != "run_failed" else FAILED_SHUTDOWN_S)
        (self.run_dir / "staleness.json").write_text(json.dumps(
            {"counts": {str(k): v for k, v in sorted(self.staleness_counts.items())}, "drops": self.buffer.drops}, indent=2))

    # ---- waits ---------------------------------------------------------------------------------
    def _receive(self, timeout: float, waiting_for: str, starting: bool = False) -> None:
        """Take one message from the actors (or time out); every wait of the trainer runs through
        here, so each is bounded by the liveness and stall checks."""
        self.heartbeats.beat("trainer")
        if (signal_name := self.stop_requested()):
            raise RunStopped(signal_name)
        try:
            message = self.spec.to_trainer.get(timeout=timeout)
        except queue.Empty:
            self._check_alive()
            self.watch.check(waiting_for, starting)
            return
        self.watch.check(waiting_for, starting)  # also while groups still arrive: a stalled actor ends the run now
        if isinstance(message, Admitted):
            self.buffer.admitted(message.index, message.born, message.task_index)
            self.watch.progressed()
        elif isinstance(message, Scored):
            self.watch.progressed()
            self._file(message.group)
        elif isinstance(message, Ready):
            self.ready_actors.add(message.actor)
            self.watch.progressed()
        elif isinstance(message, GenStats):
            self.gen_stats.append(message.stats)
        elif isinstance(message, ActorError):
            raise ActorFailed(f"the {message.actor} process failed:\n{message.traceback}")

    def _file(self, group) -> None:
        reason = self.buffer.arrived(group)
        if reason != "infra_error":
            self.infra_since = None  # something was scored: not an outage
        if reason is None:
            return
        # a backfill born now is due at step born + budget: it must not be due before the step being assembled
        self.spec.to_generator.put(Dropped(1, self.assembling - self.cfg.pipeline.max_staleness))
        if reason == "infra_error":
            now = time.monotonic()
            self.infra_since = self.infra_since or now
            if now - self.infra_since >= self.cfg.pipeline.outage_s:
                detail = group.rollouts[0].info.get("error", "")
                raise InfraUnavailable(
                    f"every group failed to be scored for {now - self.infra_since:.0f} s (pipeline.outage_s), each after "
                    f"{self.cfg.pipeline.infra_retries} retries, in environment {self.env_name!r}: {detail}; "
                    "fix the environment's infrastructure (`gapless sandbox check` for the sandbox)")
        if reason == "zero_variance":
            self.step_resamples += 1
            if self.step_resamples == self.max_resamples // 2:
                self.log(f"warning: dynamic sampling dropped {self.step_resamples} zero-variance groups for step "
                         f"{self.assembling + 1} (stops at pipeline.max_resamples = {self.max_resamples})")
            if self.step_resamples >= self.max_resamples:
                raise ResamplesExhausted(
                    f"pipeline.dynamic_sampling dropped {self.step_resamples} groups for step {self.assembling + 1}, all with "
                    f"equal rewards (pipeline.max_resamples = {self.max_resamples}): the prompts are always or never solved; "
                    "use pipeline.curriculum = 'pass_rate', other data, or set pipeline.dynamic_sampling = false")

    def _check_waiting(self, waiting_for: str) -> None:
        self._check_alive()  # a reader killed while holding the buffer is dead, not stalled
        self.watch.check(waiting_for)

    def _check_alive(self) -> None:
        for gone in self.placement.exited():
            raise ActorFailed(f"{gone.name} exited with code {gone.exitcode} without reporting an error "
                              "(killed by the OOM killer or a signal?); see the system log")

