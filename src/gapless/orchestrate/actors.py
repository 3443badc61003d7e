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
processes) and forwards them; rewards also go back to the generator for the curriculum.

Both actors send ('error', actor, traceback) to the trainer and exit if anything raises, so a
crash is an error in the trainer's process, never a silent hang (the trainer also notices an
actor that died without a word). Both die with the trainer, even when it is SIGKILLed (the
kernel's parent-death signal). Neither actor holds state worth keeping: the trainer's checkpoint
is the run's state.
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
from gapless.orchestrate.lending import LendingFlags
from gapless.orchestrate.partial import PartialRollouts
from gapless.orchestrate.weights import SharedWeights
from gapless.timeline import MergedSpans, open_timeline
from gapless.types import Completion

POLL_S = 0.002
STATS_EVERY_S = 0.05
LENDING_MAX_WAIT_S = 0.02  # the longest the generator waits for its lent threads before decoding


@dataclass
class ActorSpec:
    """What every actor process needs; picklable."""

    cfg: Config
    prompts: list[tuple[str, str]]  # (uid, prompt text) of the train tasks, in env.tasks("train") order
    policy_dir: Path
    start_step: int
    weights: SharedWeights
    to_env: Any  # queue of ('group', index, task_index, born, completions)
    to_trainer: Any  # queue of ('admitted' | 'scored' | 'gen_stats' | 'error', ...)
    to_generator: Any  # queue of ('dropped', n) | ('abort', [index]) | ('feedback', uid, rewards)
    stop: Any  # event
    trainer_pid: int
    lending: LendingFlags | None = None  # the trainer borrows the generator's threads while it idles


def _put(q, item, stop) -> float:
    """Put with back-pressure; returns seconds blocked. Gives up when the run stops."""
    start = time.perf_counter()
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            break
        except queue.Full:
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
        spec.to_trainer.put(("error", actor, traceback.format_exc()), timeout=5)
    except Exception:
        pass


def generator_main(spec: ActorSpec) -> None:
    _die_with_trainer(spec)
    try:
        actor = _GeneratorActor(spec)
        spec.to_trainer.put(("ready", "generator"))
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
            kind = message[0]
            if kind == "dropped":
                self.admission.dropped += message[1]
            elif kind == "abort":
                ids = [i for i in message[1] if i in self.groups]
                self.engine.abort([str(i) for i in ids])
                for i in ids:
                    self.groups.pop(i, None)
                    self.meta.pop(i, None)
            elif kind == "feedback":
                self.source.feedback(message[1], message[2])

    def _admit(self) -> None:
        while self.admission.may_admit(self.engine.version):
            index = self.admission.admit()
            task = self.source.task_for(index)
            self.engine.add_request(self.prompts[task], sampling_params(self.cfg, index), self.cfg.generator.group_size,
                                    request_id=str(index))
            self.groups[index], self.meta[index] = [], (task, self.engine.version)
            self.clock["blocked_s"] += _put(self.spec.to_trainer, ("admitted", index, self.engine.version), self.spec.stop)

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
                self.clock["blocked_s"] += _put(self.spec.to_env, ("group", index, task, born, group), self.spec.stop)

    def _cut_partial(self) -> None:
        cut = self.partial.cut(self.engine, lambda request_id: sampling_params(self.cfg, int(request_id)))
        self.clock["partial_cuts"] += len(cut)

    def _report(self) -> None:
        now = time.perf_counter()
        stats = dict(self.clock, wall_s=now - self.last_report, version=self.engine.version,
                     running=self.engine.num_running, waiting=self.engine.num_waiting)
        _put(self.spec.to_trainer, ("gen_stats", stats), self.spec.stop)
        self.clock = dict.fromkeys(self.clock, 0.0)
        self.last_report = now


def environment_main(spec: ActorSpec) -> None:
    _die_with_trainer(spec)
    try:
        _environment_loop(spec)
    except BaseException:
        _report_crash(spec, "environment")


def _environment_loop(spec: ActorSpec) -> None:
    from gapless.envs.registry import make_environment

    cfg = spec.cfg
    torch.set_num_threads(1)
    env = make_environment(cfg)
    tasks = list(env.tasks("train"))
    if [t.uid for t in tasks] != [uid for uid, _ in spec.prompts]:
        raise RuntimeError(f"environment {env.name!r} built different train tasks in the environment process; "
                           "the pipeline needs env.tasks() to be deterministic in the config")
    timeline = open_timeline(cfg.run_dir, "env", cfg.metrics.timeline)
    spec.to_trainer.put(("ready", "environment"))
    workers = cfg.pipeline.env_workers
    slots = threading.Semaphore(workers)  # back-pressure: take a group only when a worker is free
    failures: list[str] = []

    def score(index: int, task_index: int, born: int, completions: list[Completion]) -> None:
        try:
            with timeline.span("score", group=index):
                rollouts = env.score_groups([tasks[task_index]], [completions])[0]
            _put(spec.to_trainer, ("scored", ScoredGroup(index, task_index, born, rollouts)), spec.stop)
            spec.to_generator.put(("feedback", tasks[task_index].uid, [r.reward for r in rollouts if not r.is_infra_failure]))
        except BaseException:
            failures.append(traceback.format_exc())
        finally:
            slots.release()

    with ThreadPoolExecutor(workers, thread_name_prefix="score") as pool:
        try:
            while not spec.stop.is_set() and not failures:
                if not slots.acquire(timeout=0.1):
                    continue
                try:
                    _, index, task_index, born, completions = spec.to_env.get(timeout=0.1)
                except queue.Empty:
                    slots.release()
                    continue
                pool.submit(score, index, task_index, born, completions)
            if failures:
                spec.to_trainer.put(("error", "environment", failures[0]))
        finally:
            env.close()
            timeline.close()
