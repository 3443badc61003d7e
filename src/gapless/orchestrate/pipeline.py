"""The asynchronous pipeline: generator, environment and trainer as processes, bounded by a
staleness budget. `pipeline.max_staleness = 0` is the synchronous loop on the same code path.

    generator process ──groups──> environment process ──scored groups──> trainer (this process)
          ^    (engine, admission)        (sandbox, env_workers threads)     (buffer, GRPO step)
          └──────────── SharedWeights (version v+1) <──── publish after each step ─────┘

The trainer process owns the run: the policy, the optimizer, evaluation (greedy pass@1 on its own
engine copy), checkpoints and metrics. A step: drain the inbound queue until the
`StalenessBuffer` says step t's batch is ready (this wait is the trainer's idle time), take it
(asserting each group's staleness <= max_staleness), tell the generator what was dropped (so it
backfills) and which stragglers to cut, build the batch exactly as the reference loop does, take
the GRPO step and publish the weights (one memory copy; the generator swaps them in between two
decode steps without dropping sequences in flight).

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
import multiprocessing as mp
import os
import queue
import time
from collections import Counter

import torch

from gapless.config import Config, ConfigError
from gapless.envs.base import InfraUnavailable, check_infra
from gapless.generate.protocol import SteppedGenerator
from gapless.errors import InfrastructureError, RunStopped
from gapless.faults import fault_point
from gapless.orchestrate.actors import ActorSpec, environment_main, generator_main
from gapless.orchestrate.buffer import StalenessBuffer
from gapless.orchestrate.evaluate import EvalScore, greedy_pass_at_1
from gapless.orchestrate.ipc import clean_leftover_ipc, name_ipc_objects
from gapless.orchestrate.ledger import GroupLedger
from gapless.orchestrate.lending import LendingFlags, TrainerLending
from gapless.orchestrate.loop import SyncLoop, rollout_metrics, staleness_metrics
from gapless.orchestrate.messages import (Abort, ActorError, Admitted, CancelScoring, Dropped, GenStats, Ready, Scored)
from gapless.orchestrate.watchdog import Heartbeats, StallWatch
from gapless.orchestrate.weights import SharedWeights
from gapless.timeline import export_chrome_trace

SHUTDOWN_S = 10.0
FAILED_SHUTDOWN_S = 1.0  # after a failure or stall the actors' work is lost anyway: stop the run promptly
INBOX_MESSAGES = 4096  # bound of the trainer's inbound queue (records, scored groups, stats)


class ActorFailed(InfrastructureError):
    """A pipeline actor process raised or died; the message carries its traceback or exit code."""


class ResamplesExhausted(ConfigError):
    """Dynamic sampling dropped more zero-variance groups in one step than pipeline.max_resamples."""


class Pipeline(SyncLoop):
    """Shares the reference loop's setup (policy, trainer, evaluation, checkpoints, summary) and
    replaces its step: batches come from the actors instead of a blocking generate-score cycle."""

    def __init__(self, cfg: Config, resume: bool = False, log=print):
        _check_threads(cfg)
        torch.set_num_threads(cfg.pipeline.trainer_threads_resolved)
        super().__init__(cfg, resume, log)
        if not isinstance(self.sampler, SteppedGenerator):
            raise ConfigError(f"generator.engine = '{cfg.generator.engine}' cannot run the pipeline: use 'torch' or 'vllm'")
        self.ctx = mp.get_context("spawn")
        if (removed := clean_leftover_ipc(self.run_dir)):
            log(f"removed {removed} semaphores left in /dev/shm by a crashed run in {self.run_dir}")
        name_ipc_objects(self.run_dir)
        self.ledger = GroupLedger(self.run_dir / "groups.jsonl", resume_step=self.start_step if resume else None)
        self.buffer = StalenessBuffer(cfg.loop.prompts_per_step, cfg.pipeline.max_staleness, cfg.pipeline.oversample > 0,
                                      self.ledger, cfg.pipeline.dynamic_sampling, [t.uid for t in self.train])
        self.heartbeats = Heartbeats(self.ctx)
        self.heartbeats.register("trainer")
        self.watch = StallWatch(self.heartbeats, cfg.pipeline.stall_timeout_s, self.run_dir, ("generator", "environment"))
        self.max_resamples = cfg.pipeline.max_resamples or 8 * cfg.loop.prompts_per_step
        self.step_resamples = 0  # zero-variance drops while assembling the current step
        self.drops_reported: dict[str, int] = {}  # buffer.drops at the last step's metrics
        self.assembling = self.start_step  # the step whose batch the buffer is filling
        self.staleness_counts: Counter[int] = Counter()
        self.gen_stats: list[dict] = []
        self.processes: list = []
        self.ready_actors: set[str] = set()
        self.infra_since: float | None = None  # when groups started failing in the infrastructure (None: none failing)
        self._last_step_end = None
        self.lending: TrainerLending | None = None
        pl = cfg.pipeline
        if pl.max_staleness > 0 and pl.lend_idle_cores:
            self.lending = TrainerLending(LendingFlags(self.ctx), pl.trainer_threads_resolved, pl.generator_threads_resolved)
            if not self.lending.install(self.policy.model):
                self.lending = None  # no decoder layer list to hook: nothing to lend at

    # ---- actors ---------------------------------------------------------------------------
    def start_actors(self) -> None:
        policy_dir = self.run_dir / "generator_policy"
        self.policy.save(policy_dir)  # architecture and tokenizer; the weights come through shared memory
        self.weights = SharedWeights(self.trainer.state_for_push(), self.trainer.version, self.ctx)
        bound = 2 * self.cfg.loop.prompts_per_step  # groups waiting to be scored
        prompts = [(task.uid, task.prompt) for task in self.train]
        self.spec = ActorSpec(self.cfg, prompts, policy_dir, self.start_step, self.weights, self.ctx.Queue(bound),
                              self.ctx.Queue(INBOX_MESSAGES), self.ctx.Queue(), self.ctx.Queue(), self.ctx.Event(),
                              os.getpid(), self.heartbeats, self.lending.flags if self.lending else None)
        for name, target in (("generator", generator_main), ("environment", environment_main)):
            process = self.ctx.Process(target=target, args=(self.spec,), name=f"gapless-{name}", daemon=True)
            process.start()
            self.processes.append(process)

    def stop_actors(self, grace_s: float = SHUTDOWN_S) -> None:
        """Ask the actors to stop, wait `grace_s` for them, then kill what is left."""
        if not self.processes:
            return
        self.spec.stop.set()
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []

    def run(self) -> dict:
        self.start_actors()
        reason = "run_failed"
        try:
            summary = super().run()
            reason = "run_ended"
            return summary
        except (RunStopped, KeyboardInterrupt):
            reason = "run_stopped"
            raise
        finally:
            self.buffer.close(self.trainer.version, reason)
            self.ledger.close()
            self.stop_actors(SHUTDOWN_S if reason != "run_failed" else FAILED_SHUTDOWN_S)
            (self.run_dir / "staleness.json").write_text(json.dumps(
                {"counts": {str(k): v for k, v in sorted(self.staleness_counts.items())}, "drops": self.buffer.drops}, indent=2))
            if self.cfg.metrics.timeline:
                export_chrome_trace(self.run_dir)  # again, now that the actors' files are complete

    def evaluate(self) -> EvalScore:
        """Greedy pass@1 on the trainer's current weights (the trainer process's own engine copy)."""
        with self.timelines["trainer"].span("eval", version=self.trainer.version):
            if self.sampler.version != self.trainer.version:
                self.sampler.update_weights(self.trainer.state_for_push(), self.trainer.version)
            return greedy_pass_at_1(self.sampler, self.env, self.eval, self.policy.encode, self.cfg.generator.max_new_tokens)

    # ---- one step ------------------------------------------------------------------------
    def _receive(self, timeout: float, waiting_for: str, starting: bool = False) -> None:
        """Take one message from the actors (or time out); every wait of the trainer runs through
        here, so each is bounded by the liveness and stall checks."""
        self.heartbeats.beat("trainer")
        if self.stop_requested:
            raise RunStopped(self.stop_requested)
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
                    f"{self.cfg.pipeline.infra_retries} retries, in environment {self.env.name!r}: {detail}; "
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
        for process in self.processes:
            if not process.is_alive():
                raise ActorFailed(f"{process.name} exited with code {process.exitcode} without reporting an error "
                                  "(killed by the OOM killer or a signal?); see the system log")

    def train_step(self, step: int) -> dict[str, float]:
        t0 = self._last_step_end or time.perf_counter()
        self.assembling, self.step_resamples = step, 0
        self.watch.progressed()  # the trainer's own work since the last wait (train, eval, checkpoint) is no stall
        if len(self.ready_actors) < len(self.processes):
            with self.timelines["trainer"].span("wait_actors_start"):  # spawn, imports, engine, sandbox
                while len(self.ready_actors) < len(self.processes):
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
        fault_point("trainer", "step")
        if cut:
            self.spec.to_generator.put(Abort(tuple(cut)))
            self.spec.env_control.put(CancelScoring(tuple(cut)))
        freed = self.buffer.num_dropped - drops_before  # stragglers and surplus free places to backfill,
        if freed:  # each born no earlier than this step's weights allow
            self.spec.to_generator.put(Dropped(freed, step + 1 - self.cfg.pipeline.max_staleness))
        rollouts = [r for g in groups for r in g.rollouts]
        infra_errors = check_infra(rollouts, hint=f" in environment {self.env.name!r}")
        t1 = time.perf_counter()
        with self.timelines["trainer"].span("train", step=step, version=self.trainer.version), \
                self.lending.borrowing() if self.lending else contextlib.nullcontext():
            batch, targets = self.make_batch(rollouts)
            stats = self.trainer.step(batch)
        t2 = time.perf_counter()
        with self.timelines["trainer"].span("weight_push", version=self.trainer.version):
            try:
                waiting_for = f"the generator to release the weight buffer (publishing version {self.trainer.version})"
                push_wait = self.weights.publish(self.trainer.state_for_push(), self.trainer.version,
                                                 self.cfg.pipeline.stall_timeout_s, lambda: self._check_waiting(waiting_for))
            except TimeoutError:  # the publish waited the whole stall timeout
                self.watch.stall(waiting_for, self.cfg.pipeline.stall_timeout_s, ["generator"])
        t3 = time.perf_counter()
        self._last_step_end = t3
        staleness = [step - r.completion.oldest_version for r in rollouts]
        self.staleness_counts.update(staleness)
        return {
            **rollout_metrics(rollouts, targets.zero_variance_groups, len(groups)),
            **targets.metrics,
            "sandbox/infra_errors": float(infra_errors),
            **self.train_metrics(stats),
            **self._pipeline_metrics(t3 - t0, waited, t2 - t1, t3 - t2, push_wait, staleness, stats.num_tokens),
        }

    def _pipeline_metrics(self, step_s, waited_s, train_s, push_s, push_wait_s, staleness, trained_tokens) -> dict[str, float]:
        gen = self.gen_stats
        self.gen_stats = []
        gen_wall = sum(s["wall_s"] for s in gen)
        swaps = sum(s["swaps"] for s in gen)
        metrics = {
            "perf/step_s": step_s,  # from the end of the previous step (the first: from the actors' start)
            "perf/train_s": train_s,
            "perf/weight_push_s": push_s,
            "perf/weight_push_wait_s": push_wait_s,
            "perf/trainer_idle_frac": waited_s / max(step_s, 1e-9),
            **staleness_metrics(staleness),
            "perf/trained_tokens_per_s": trained_tokens / max(train_s, 1e-9),
        }
        if self.lending is not None:
            metrics["perf/trainer_borrowed_frac"] = self.lending.borrowed_frac()  # layer checks holding the generator's threads
        if gen_wall > 0:
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


def _check_threads(cfg: Config) -> None:
    """With a budget the actors run at once, so their threads must fit the cores; at budget 0 they
    take turns (the generator waits for each step's weights), so each may use every core."""
    if cfg.pipeline.max_staleness == 0:
        return
    cores = len(os.sched_getaffinity(0))
    used = cfg.pipeline.generator_threads_resolved + cfg.pipeline.trainer_threads_resolved
    if used > max(cores, 2):
        raise ConfigError(f"pipeline.generator_threads + pipeline.trainer_threads = {used} exceeds the {cores} cores "
                          "available; lower them (0 = split the cores automatically)")
