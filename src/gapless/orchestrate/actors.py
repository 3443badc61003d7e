"""The pipeline's generator and environment actors, each the main function of its own process.

    generator ──(group, bounded queue)──> environment ──(scored group)──> trainer (pipeline.py)
        ^  admitted / stats ─────────────────────────────────────────────────^   │
        └── control: dropped (backfill), abort (stragglers), feedback (curriculum) ┘
        └── weights: SharedWeights, fetched between decode steps

Generator: holds the stepped engine; between decode steps it loads newer weights if published
(in-flight sequences continue; their next tokens carry the new version), applies control
messages, admits groups while `Admission` allows, and decodes. With `partial_rollout_tokens` or
`partial_rollout_s`, a group past its token or time deadline while others wait for a slot is cut
and resumed at the back of the queue (re-prefilled by the weights current then; partial.py). It reports
'admitted' records and busy / idle / stall times to the trainer.
Environment: scores groups on `env_workers` threads (the sandbox runs the programs in its own
processes) and forwards them; rewards also go back to the generator for the curriculum. A group
whose every rollout failed in the infrastructure is scored again after 1, 2, 4, ... s
(`pipeline.infra_retries`) before it goes to the trainer, which stops the run only when such
groups keep coming for `pipeline.outage_s`.

Messages are the typed records of messages.py. Both actors send `ActorError` to the trainer and
exit if anything raises, so a crash is an error in the trainer's process, never a silent hang
(the trainer also notices an actor that died without a word). Both stamp their heartbeat on
every pass of their loop, no wait of theirs blocks longer than a poll, and both dump their
Python stacks on SIGUSR1 (watchdog.py: a stalled actor is diagnosed, not waited for). Both die
with the trainer, even when it is SIGKILLed (the kernel's parent-death signal). Neither actor
holds state worth keeping: the trainer's checkpoint is the run's state.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gapless.config import Config
from gapless.orchestrate.admission import Admission, PromptSource, sampling_params
from gapless.orchestrate.buffer import ScoredGroup
from gapless.faults import fault_point
from gapless.orchestrate.lending import LendingFlags
from gapless.orchestrate.messages import (Abort, ActorError, Admitted, CancelScoring, Dropped, Feedback, GenStats, Ready,
                                          Scored, ToScore)
from gapless.orchestrate.partial import PartialRollouts
from gapless.orchestrate.watchdog import Heartbeats, install_stack_dump
from gapless.orchestrate.weights import SharedWeights
from gapless.timeline import MergedSpans, open_timeline
from gapless.types import Completion

POLL_S = 0.002
STATS_EVERY_S = 0.05
LENDING_MAX_WAIT_S = 0.02
INFRA_BACKOFF_MAX_S = 30.0  # longest pause before scoring a group that failed in the infrastructure again  # the longest the generator waits for its lent threads before decoding


@dataclass
class ActorSpec:
    """What every actor process needs; picklable."""

    cfg: Config
    prompts: list[tuple[str, str]]  # (uid, prompt text) of the train tasks, in env.tasks("train") order
    policy_dir: Path
    start_step: int
    weights: SharedWeights
    to_env: Any  # queue of ToScore
    to_trainer: Any  # queue of Admitted | Scored | Ready | GenStats | ActorError
    to_generator: Any  # queue of Dropped | Abort | Feedback
    env_control: Any  # queue of CancelScoring
    stop: Any  # event
    trainer_pid: int
    heartbeats: Heartbeats
    lending: LendingFlags | None = None  # the trainer borrows the generator's threads while it idles


def _put(q, item, stop, beat=None) -> float:
    """Put with back-pressure; returns seconds blocked. Gives up when the run stops."""
    start = time.perf_counter()
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            break
        except queue.Full:
            if beat is not None:
                beat()  # alive, blocked by whoever should drain the queue
            continue
    return time.perf_counter() - start


def _die_with_trainer(spec: ActorSpec) -> None:
    """A killed trainer must not leave actors behind (they are not its threads): ask the kernel
    to SIGKILL this process when its parent dies, and exit if that already happened."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec.trainer_pid:
        os._exit(1)


def _report_crash(spec: ActorSpec, actor: str) -> None:
    try:
        spec.to_trainer.put(ActorError(actor, traceback.format_exc()), timeout=5)
    except Exception:
        pass


def _start_actor(spec: ActorSpec, actor: str) -> None:
    _die_with_trainer(spec)
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the trainer alone decides
    # (it finishes the step, checkpoints, then stops the actors through `spec.stop`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec.heartbeats.register(actor)
    install_stack_dump(Path(spec.cfg.run_dir), actor)


def generator_main(spec: ActorSpec) -> None:
    _start_actor(spec, "generator")
    try:
        with spec.heartbeats.beating("generator"):
            actor = _GeneratorActor(spec)
        spec.to_trainer.put(Ready("generator"))
        actor.run()
    except BaseException:
        _report_crash(spec, "generator")


class _GeneratorActor:
    def __init__(self, spec: ActorSpec):
        from gapless.generate import make_generator
        from gapless.models import load_local

        cfg = self.cfg = spec.cfg
        self.spec = spec
        torch.set_num_threads(cfg.pipeline.generator_threads_resolved)
        self.policy = load_local(spec.policy_dir)
        self.prompts = [self.policy.encode(prompt) for _, prompt in spec.prompts]
        max_seq_len = max(map(len, self.prompts)) + cfg.generator.max_new_tokens
        self.engine = make_generator(cfg.generator, self.policy, max_seq_len, Path(cfg.run_dir))
        spec.weights.fetch_into(self.engine.update_weights, -1)
        P = cfg.loop.prompts_per_step
        self.admission = Admission(P, cfg.pipeline.max_staleness, cfg.pipeline.oversample, spec.start_step)
        self.source = PromptSource(cfg.seed, [uid for uid, _ in spec.prompts], P, cfg.pipeline.curriculum)
        self.pending_drops: list[Dropped] = []  # places freed, usable from a policy version on
        self.groups: dict[int, list[Completion]] = {}
        self.meta: dict[int, tuple[int, int]] = {}  # index -> (task index, birth version)
        self.cut: set[int] = set()
        self.partial = PartialRollouts(cfg.pipeline.partial_rollout_tokens, cfg.pipeline.partial_rollout_s)
        self.clock = {"busy_s": 0.0, "idle_s": 0.0, "stall_s": 0.0, "blocked_s": 0.0, "core_wait_s": 0.0, "tokens": 0, "groups": 0, "swaps": 0, "partial_cuts": 0}
        self.last_report = time.perf_counter()
        self.timeline = open_timeline(cfg.run_dir, "generator", cfg.metrics.timeline)
        self.spans = MergedSpans(self.timeline)

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.spans.close()
            self.timeline.close()

    def _loop(self) -> None:
        spec = self.spec
        while not spec.stop.is_set():
            spec.heartbeats.beat("generator")
            start = time.perf_counter()
            if spec.weights.fetch_into(self.engine.update_weights, self.engine.version) is not None:
                self.clock["stall_s"] += time.perf_counter() - start
                self.clock["swaps"] += 1
                self.spans.mark("weight_load")
                self.timeline.instant("weights", version=self.engine.version)
            self._apply_control()
            self._admit()
            if self.engine.has_work:
                if spec.lending is not None:
                    self.clock["core_wait_s"] += spec.lending.want(LENDING_MAX_WAIT_S)
                self.spans.mark("generate")
                start = time.perf_counter()
                finished = self.engine.step()
                fault_point("generator", "decode")
                self.clock["busy_s"] += time.perf_counter() - start
                self.clock["tokens"] += self.engine.num_running + len(finished)
                self._collect(finished)
                self._cut_partial()
            else:
                if spec.lending is not None:
                    spec.lending.idle()
                self.spans.mark("wait_weights")  # admission holds until a newer policy arrives
                start = time.perf_counter()
                self._apply_control(timeout=POLL_S)
                self.clock["idle_s"] += time.perf_counter() - start
            if time.perf_counter() - self.last_report > STATS_EVERY_S:
                self._report()

    def _apply_control(self, timeout: float = 0.0) -> None:
        while True:
            try:
                message = self.spec.to_generator.get(timeout=timeout) if timeout else self.spec.to_generator.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            if isinstance(message, Dropped):
                self.pending_drops.append(message)
            elif isinstance(message, Abort):
                ids = [i for i in message.indices if i in self.groups]
                self.engine.abort([str(i) for i in ids])
                for i in ids:
                    self.groups.pop(i, None)
                    self.meta.pop(i, None)
            elif isinstance(message, Feedback):
                self.source.feedback(message.uid, list(message.rewards))

    def _release_drops(self) -> None:
        """Freed places become admissible once this engine holds a version a backfill may be
        born at: earlier, its group would already be due at a step the trainer has taken."""
        usable = [d for d in self.pending_drops if d.min_version <= self.engine.version]
        if usable:
            self.admission.dropped += sum(d.count for d in usable)
            self.pending_drops = [d for d in self.pending_drops if d.min_version > self.engine.version]

    def _admit(self) -> None:
        self._release_drops()
        while self.admission.may_admit(self.engine.version):
            index = self.admission.admit()
            task = self.source.task_for(index)
            self.engine.add_request(self.prompts[task], sampling_params(self.cfg, index), self.cfg.generator.group_size,
                                    request_id=str(index))
            self.groups[index], self.meta[index] = [], (task, self.engine.version)
            self.clock["blocked_s"] += _put(self.spec.to_trainer, Admitted(index, task, self.engine.version), self.spec.stop,
                                            self._beat)

    def _beat(self) -> None:
        self.spec.heartbeats.beat("generator")

    def _collect(self, finished: list[Completion]) -> None:
        n = self.cfg.generator.group_size
        for completion in finished:
            index = int(completion.request_id)
            group = self.groups.get(index)
            if group is None:
                continue
            group.append(completion)
            if len(group) == n:
                task, born = self.meta.pop(index)
                del self.groups[index]
                group.sort(key=lambda c: c.index)
                self.clock["groups"] += 1
                self.spans.mark("wait_env_queue")
                self.clock["blocked_s"] += _put(self.spec.to_env, ToScore(index, task, born, group), self.spec.stop, self._beat)

    def _cut_partial(self) -> None:
        cut = self.partial.cut(self.engine, lambda request_id: sampling_params(self.cfg, int(request_id)))
        self.clock["partial_cuts"] += len(cut)

    def _report(self) -> None:
        now = time.perf_counter()
        stats = dict(self.clock, wall_s=now - self.last_report, version=self.engine.version,
                     running=self.engine.num_running, waiting=self.engine.num_waiting)
        _put(self.spec.to_trainer, GenStats(stats), self.spec.stop, self._beat)
        self.clock = dict.fromkeys(self.clock, 0.0)
        self.last_report = now


def environment_main(spec: ActorSpec) -> None:
    _start_actor(spec, "environment")
    try:
        _environment_loop(spec)
    except BaseException:
        _report_crash(spec, "environment")


def _environment_loop(spec: ActorSpec) -> None:
    from gapless.envs.registry import make_environment

    cfg = spec.cfg
    torch.set_num_threads(1)
    with spec.heartbeats.beating("environment"):
        env = make_environment(cfg)
    tasks = list(env.tasks("train"))
    if [t.uid for t in tasks] != [uid for uid, _ in spec.prompts]:
        raise RuntimeError(f"environment {env.name!r} built different train tasks in the environment process; "
                           "the pipeline needs env.tasks() to be deterministic in the config")
    timeline = open_timeline(cfg.run_dir, "env", cfg.metrics.timeline)
    spec.to_trainer.put(Ready("environment"))
    workers = cfg.pipeline.env_workers
    slots = threading.Semaphore(workers)  # back-pressure: take a group only when a worker is free
    failures: list[str] = []
    cancelled: set[int] = set()  # groups the trainer cut: not scored if queued, not sent if scoring
    beat = lambda: spec.heartbeats.beat("environment")  # noqa: E731

    def score(item: ToScore) -> None:
        try:
            with timeline.span("score", group=item.index):
                rollouts = env.score_groups([tasks[item.task_index]], [item.completions])[0]
                for attempt in range(cfg.pipeline.infra_retries):  # an outage is retried, never trained on
                    if not all(r.is_infra_failure for r in rollouts) or item.index in cancelled or spec.stop.is_set():
                        break
                    spec.stop.wait(min(2.0 ** attempt, INFRA_BACKOFF_MAX_S))
                    rollouts = env.score_groups([tasks[item.task_index]], [item.completions])[0]
            fault_point("environment", "score")
            if item.index in cancelled:
                return
            _put(spec.to_trainer, Scored(ScoredGroup(item.index, item.task_index, item.born, rollouts)), spec.stop, beat)
            valid = tuple(r.reward for r in rollouts if not r.is_infra_failure)
            spec.to_generator.put(Feedback(tasks[item.task_index].uid, valid))
        except BaseException:
            failures.append(traceback.format_exc())
        finally:
            slots.release()

    def take_cancellations() -> None:
        while True:
            try:
                cancelled.update(spec.env_control.get_nowait().indices)
            except queue.Empty:
                return

    with ThreadPoolExecutor(workers, thread_name_prefix="score") as pool:
        try:
            while not spec.stop.is_set() and not failures:
                beat()
                take_cancellations()
                if not slots.acquire(timeout=0.1):
                    continue
                try:
                    item = spec.to_env.get(timeout=0.1)
                except queue.Empty:
                    slots.release()
                    continue
                take_cancellations()
                if item.index in cancelled:
                    slots.release()
                    continue
                pool.submit(score, item)
            if failures:
                spec.to_trainer.put(ActorError("environment", failures[0]))
        finally:
            env.close()
            timeline.close()
