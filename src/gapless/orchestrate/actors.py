"""The pipeline's generator replicas and environment actor, each the main function of its own process.

    trainer ──Assign──> generator replica r ──(group, its own bounded queue)──> environment ──Scored──> trainer
       ^   Loaded (version) / GenStats ───────────────────────────────────────────────────────────^
       └── Abort (stragglers) ──> replica r;  CancelScoring ──> environment
       └── weights: one SharedWeights per replica, fetched between decode steps

Generator replica: holds the stepped engine; between decode steps it loads newer weights if
published (in-flight sequences continue; their next tokens carry the new version) and reports
the version it now holds (`Loaded`), starts the groups the trainer assigns it (admission is
central: dispatch.py), and decodes. With `partial_rollout_tokens` or `partial_rollout_s`, a group
past its token or time deadline while others wait for a slot is cut and resumed at the back of
the queue (re-prefilled by the weights current then; partial.py). It reports busy / idle / stall
times to the trainer every STATS_EVERY_S, and with the group that leaves it with nothing to
decode (the report rides in ToScore and Scored), so every synchronous step carries one however
short it is; a report on a cut group is passed on alone.
Environment: scores groups on `env_workers` threads (the sandbox runs the programs in its own
processes) and forwards them; one reader thread per replica queue, so a replica killed in the
middle of a write blocks only its own reader. A group whose every rollout failed in the
infrastructure is scored again after 1, 2, 4, ... s (`pipeline.infra_retries`) before it goes to
the trainer, which stops the run only when such groups keep coming for `pipeline.outage_s`.

Messages are the typed records of messages.py; every queue has one writer. Both kinds of actor
send `ActorError` to the trainer and exit if anything raises, so a crash is an error in the
trainer's process, never a silent hang (the trainer also notices an actor that died without a
word). Each stamps its heartbeat on every pass of its loop, no wait of theirs blocks longer than a
poll, each marks its progress (a replica per decode step and weight load, the environment per group
scored and tool call answered), and each dumps its Python stacks on SIGUSR1 (cluster/watchdog.py: a
stalled actor is diagnosed, not waited for). All die with the trainer, even when it is SIGKILLed (the
kernel's parent-death signal). No actor holds state worth keeping: the trainer's checkpoint is the run's state.
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Callable

import torch

from gapless.cluster.watchdog import Heartbeats, StopFlag, install_stack_dump
from gapless.cluster.weights import SharedWeights
from gapless.config import Config
from gapless.envs.turns import queue_turn
from gapless.faults import fault_point, name_process
from gapless.orchestrate.admission import sampling_params
from gapless.orchestrate.lending import LendingFlags
from gapless.orchestrate.messages import (
    Abort,
    ActorError,
    Assign,
    GenStats,
    Loaded,
    NextTurns,
    Ready,
    Scored,
    StartEpisodes,
    ToScore,
    TurnDone,
)
from gapless.orchestrate.partial import PartialRollouts
from gapless.timeline import MergedSpans, open_timeline
from gapless.types import Completion, Group

POLL_S = 0.002
STATS_EVERY_S = 0.05
LENDING_MAX_WAIT_S = 0.02
INFRA_BACKOFF_MAX_S = 30.0  # longest pause before scoring a group that failed in the infrastructure again  # the longest the generator waits for its lent threads before decoding


@dataclass
class ActorSpec:
    """What one actor process needs; picklable at spawn."""

    cfg: Config
    name: str  # 'generator' (one replica), 'generator-<r>', 'environment', 'environment-<e>': heartbeat, timeline, fault and process name
    prompts: list[tuple[str, str]]  # (uid, prompt text) of the train tasks, in env.tasks("train") order
    policy_dir: Path
    trainer_pid: int  # 0: not the trainer's child (a Ray actor)
    heartbeats: Heartbeats
    stop: StopFlag
    inbox: Any  # trainer -> this actor: Assign | Abort (a replica), CancelScoring (the environment)
    outbox: Any  # this actor -> trainer: Ready | Loaded | GenStats | Scored | ActorError
    replica: int = 0
    weights: SharedWeights | None = None  # a replica's own weight buffer (the placement's: SharedWeights locally)
    to_env: tuple = ()  # a replica's queues of ToScore, one per environment slot (env_actors.py)
    from_generators: tuple = ()  # the environment's: every replica's queue (restarts' included)
    lending: LendingFlags | None = (
        None  # the trainer borrows the generator's threads while it idles and nothing is scored
    )
    from_env: Any = None  # a replica's queue of NextTurns from the environment (multi-turn tasks only)
    to_generators: tuple = ()  # the environment's: every replica slot's NextTurns queue (multi-turn tasks)
    max_seq_len: int = (
        0  # a replica's longest context to hold (the longest prompt's, or an episode's, + max_new_tokens)
    )


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
    if spec.trainer_pid == 0:
        return  # a Ray actor: Ray ties its life to the trainer (cluster/ray/placement.py)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec.trainer_pid:
        os._exit(1)


def _report_crash(spec: ActorSpec) -> None:
    try:
        spec.outbox.put(ActorError(spec.name, traceback.format_exc()), timeout=5)
    except Exception:
        pass


def _start_actor(spec: ActorSpec) -> None:
    _die_with_trainer(spec)
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the trainer alone decides
    # (it finishes the step, checkpoints, then stops the actors through `spec.stop`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec.heartbeats.register(spec.name)
    name_process(spec.name)
    install_stack_dump(Path(spec.cfg.run_dir), spec.name)


def generator_main(spec: ActorSpec) -> None:
    _start_actor(spec)
    try:
        with spec.heartbeats.beating(spec.name):
            actor = _GeneratorActor(spec)
        spec.heartbeats.progress(spec.name, "set up: engine ready")
        spec.outbox.put(Ready(spec.name))
        spec.outbox.put(Loaded(spec.replica, actor.engine.version))
        actor.run()
    except BaseException:
        _report_crash(spec)


class _GeneratorActor:
    def __init__(self, spec: ActorSpec):
        from gapless.generate import make_generator
        from gapless.lora import run_spec
        from gapless.models import load_local

        cfg = self.cfg = spec.cfg
        self.spec = spec
        torch.set_num_threads(cfg.pipeline.generator_threads_resolved)
        self.policy = load_local(spec.policy_dir)
        self.prompts = [self.policy.encode(prompt) for _, prompt in spec.prompts]
        self.multi_turn = spec.from_env is not None  # sample turns the environment asks for (episode_runner.py)
        self.cut_groups: set[int] = set()  # multi-turn groups aborted: their late turns are ignored
        self.deferred: list[Assign] = []  # groups born at a version not loaded here yet, in arrival order
        self.engine = make_generator(
            cfg.generator, self.policy, spec.max_seq_len, Path(cfg.run_dir), lora=run_spec(cfg.lora, cfg.seed)
        )  # LoRA: self.policy.model is the merge's base
        spec.weights.fetch_into(self.engine.update_weights, -1)
        self.groups: dict[int, list[Completion]] = {}
        self.meta: dict[int, tuple[int, int, int]] = {}  # index -> (task index, birth version, environment slot)
        self.cut: set[int] = set()
        self.partial = PartialRollouts(cfg.pipeline.partial_rollout_tokens, cfg.pipeline.partial_rollout_s)
        self.clock = {
            "busy_s": 0.0,
            "idle_s": 0.0,
            "stall_s": 0.0,
            "blocked_s": 0.0,
            "core_wait_s": 0.0,
            "tokens": 0,
            "groups": 0,
            "swaps": 0,
            "partial_cuts": 0,
        }
        self.last_report = time.perf_counter()
        self.timeline = open_timeline(cfg.run_dir, spec.name, cfg.metrics.timeline)
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
            spec.heartbeats.beat(spec.name)
            start = time.perf_counter()
            if spec.weights.fetch_into(self.engine.update_weights, self.engine.version) is not None:
                self.clock["stall_s"] += time.perf_counter() - start
                self.clock["swaps"] += 1
                spec.heartbeats.progress(spec.name, f"applied weights version {self.engine.version}")
                self.spans.mark("weight_load")
                self.timeline.instant("weights", version=self.engine.version)
                _put(spec.outbox, Loaded(spec.replica, self.engine.version), spec.stop, self._beat)
                self._start_deferred()
            self._apply_control()
            if self.engine.has_work:
                if spec.lending is not None:
                    self.clock["core_wait_s"] += spec.lending.want(LENDING_MAX_WAIT_S)
                self.spans.mark("generate")
                start = time.perf_counter()
                finished = self.engine.step()
                fault_point("generator", "decode", self._beat)
                self.clock["busy_s"] += time.perf_counter() - start
                decoded = self.engine.num_running + len(finished)
                self.clock["tokens"] += decoded
                if decoded:
                    self._progressed(decoded)
                self._collect(finished)
                self._cut_partial()
            else:
                if spec.lending is not None:
                    spec.lending.idle()
                self.spans.mark("wait_weights")  # no group assigned: admission holds until a newer policy arrives
                start = time.perf_counter()
                self._apply_control(timeout=POLL_S)
                self.clock["idle_s"] += time.perf_counter() - start
            if time.perf_counter() - self.last_report > STATS_EVERY_S:
                self._report()

    def _apply_control(self, timeout: float = 0.0) -> None:
        if self.multi_turn:
            self._take_turns()
        while True:
            try:
                message = self.spec.inbox.get(timeout=timeout) if timeout else self.spec.inbox.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            if isinstance(message, Assign) and (self.deferred or _born(message) > self.engine.version):
                self.deferred.append(message)  # born at a version another replica holds: start once loaded
            elif isinstance(message, Assign):
                self._start(message)
            elif isinstance(message, Abort):
                self._drop_deferred(set(message.indices))
                if self.multi_turn:
                    self.cut_groups.update(message.indices)
                    self.engine.abort([str(i) for i in message.indices])
                    continue
                ids = [i for i in message.indices if i in self.groups]
                self.engine.abort([str(i) for i in ids])
                for i in ids:
                    self.groups.pop(i, None)
                    self.meta.pop(i, None)

    def _start(self, message: Assign) -> None:
        if self.multi_turn:  # the environment runs the episodes
            self.clock["groups"] += len(message.groups)
            _put(self.spec.to_env[0], StartEpisodes(self.spec.replica, message.groups), self.spec.stop, self._beat)
            return
        for i, (index, task, born) in enumerate(message.groups):
            self.engine.add_request(
                self.prompts[task],
                sampling_params(self.cfg, index),
                self.cfg.generator.group_size,
                request_id=str(index),
            )
            scorer = message.scorers[i] if message.scorers else 0
            self.groups[index], self.meta[index] = [], (task, born, scorer)

    def _start_deferred(self) -> None:
        """Start the deferred Assigns, in order, up to the first whose birth version is not loaded."""
        while self.deferred and _born(self.deferred[0]) <= self.engine.version:
            self._start(self.deferred.pop(0))

    def _drop_deferred(self, indices: set[int]) -> None:
        """Take aborted groups out of the deferred Assigns."""
        kept = []
        for message in self.deferred:
            scorers = message.scorers or (0,) * len(message.groups)
            groups = [(g, e) for g, e in zip(message.groups, scorers) if g[0] not in indices]
            if groups:
                kept.append(Assign(tuple(g for g, _ in groups), tuple(e for _, e in groups) if message.scorers else ()))
        self.deferred = kept

    def _take_turns(self) -> None:
        """Queue every turn the environment sent (each message at once, in its order)."""
        while True:
            try:
                message = self.spec.from_env.get_nowait()
            except queue.Empty:
                return
            for request in message.turns:
                if request.group not in self.cut_groups:
                    queue_turn(self.engine, request, sampling_params(self.cfg, request.group))

    def _beat(self) -> None:
        self.spec.heartbeats.beat(self.spec.name)

    def _progressed(self, decoded: int) -> None:
        """One decode step's progress mark (microseconds against a step's milliseconds; the text
        changes only with the batch, and only a changed text is written)."""
        self.spec.heartbeats.progress(
            self.spec.name,
            f"a decode step of {decoded} tokens ({self.engine.num_running} "
            f"sequences running, {self.engine.num_waiting} waiting)",
        )

    def _collect(self, finished: list[Completion]) -> None:
        if self.multi_turn:
            for completion in finished:
                if int(completion.request_id) not in self.cut_groups:
                    self.clock["blocked_s"] += self._to_env(
                        self.spec.to_env[0], TurnDone(int(completion.request_id), completion)
                    )
            return
        n = self.cfg.generator.group_size
        done = []
        for completion in finished:
            index = int(completion.request_id)
            group = self.groups.get(index)
            if group is None:
                continue
            group.append(completion)
            if len(group) == n:
                del self.groups[index]
                group.sort(key=lambda c: c.index)
                self.clock["groups"] += 1
                done.append((index, group))
        for i, (index, group) in enumerate(done):
            task, born, scorer = self.meta.pop(index)
            # the group that empties the replica carries its report: the trainer has it by the time the
            # group is trained, so a step shorter than STATS_EVERY_S still gets its generator figures
            stats = self._stats() if i == len(done) - 1 and not self.engine.has_work else None
            self.spans.mark("wait_env_queue")
            self.clock["blocked_s"] += self._to_env(self.spec.to_env[scorer], ToScore(index, task, born, group, stats))

    def _to_env(self, q, item) -> float:
        """Put on a queue to the environment; returns seconds blocked. Blocked on a full queue, the
        replica decodes nothing: it lends the trainer its threads meanwhile, and asks for them
        back before its next decode step (as after any idle spell)."""
        try:
            q.put_nowait(item)
            return 0.0
        except queue.Full:
            if self.spec.lending is not None:
                self.spec.lending.idle()
            return _put(q, item, self.spec.stop, self._beat)

    def _cut_partial(self) -> None:
        cut = self.partial.cut(self.engine, lambda request_id: sampling_params(self.cfg, int(request_id)))
        self.clock["partial_cuts"] += len(cut)

    def _report(self) -> None:
        _put(self.spec.outbox, self._stats(), self.spec.stop, self._beat)

    def _stats(self) -> GenStats:
        """The clock since the last report (then reset)."""
        now = time.perf_counter()
        stats = dict(
            self.clock,
            wall_s=now - self.last_report,
            version=self.engine.version,
            running=self.engine.num_running,
            waiting=self.engine.num_waiting,
        )
        self.clock = dict.fromkeys(self.clock, 0.0)
        self.last_report = now
        return GenStats(stats)


def _born(message: Assign) -> int:
    return max(born for _, _, born in message.groups)


def _pass_on(stats: GenStats | None, outbox, stop, beat) -> None:
    """A cut group's replica report still reaches the trainer (on its own)."""
    if stats is not None:
        _put(outbox, stats, stop, beat)


def environment_main(spec: ActorSpec) -> None:
    _start_actor(spec)
    try:
        _environment_loop(spec)
    except BaseException:
        _report_crash(spec)


def _read_into(source, sink: queue.Queue, failed: Callable[[Exception], Any] = lambda exc: exc) -> None:
    """Forward one channel into a local queue (a thread per channel: a writer killed in the middle
    of a write leaves only this reader waiting). A read that fails goes into the queue as
    `failed(exc)`, called while the exception is handled, and the thread ends: by default the
    exception itself, for `_take` to raise in the environment's loop."""
    while True:
        try:
            item = source.get()
        except Exception as exc:  # noqa: BLE001 - e.g. ray_mail.ChannelError: the reader must fail, not wait
            sink.put(failed(exc))
            return
        sink.put(item)


def _take(source: queue.Queue, timeout: float | None = None):
    """The next item a `_read_into` thread forwarded; raises what its read raised."""
    item = source.get(timeout=timeout) if timeout is not None else source.get_nowait()
    if isinstance(item, Exception):
        raise item
    return item


def _environment_loop(spec: ActorSpec) -> None:
    from gapless.envs.registry import make_environment

    cfg = spec.cfg
    torch.set_num_threads(1)
    with spec.heartbeats.beating(spec.name):
        env = make_environment(cfg)
    tasks = list(env.tasks("train"))
    if [t.uid for t in tasks] != [uid for uid, _ in spec.prompts]:
        raise RuntimeError(
            f"environment {env.name!r} built different train tasks in the environment process; "
            "the pipeline needs env.tasks() to be deterministic in the config"
        )
    if spec.to_generators:
        return _episode_loop(spec, env, tasks)
    timeline = open_timeline(cfg.run_dir, spec.name.replace("environment", "env"), cfg.metrics.timeline)
    spec.heartbeats.progress(spec.name, "set up: environment ready")
    spec.outbox.put(Ready(spec.name))
    groups: queue.Queue = queue.Queue(maxsize=max(1, cfg.pipeline.env_workers))
    for i, source in enumerate(spec.from_generators):
        threading.Thread(target=_read_into, args=(source, groups), name=f"read-replica-{i}", daemon=True).start()
    workers = cfg.pipeline.env_workers
    slots = threading.Semaphore(workers)  # back-pressure: take a group only when a worker is free
    failures: list[str] = []
    cancelled: set[int] = set()  # groups the trainer cut: not scored if queued, not sent if scoring
    beat = lambda: spec.heartbeats.beat(spec.name)  # noqa: E731
    progress = lambda what: spec.heartbeats.progress(spec.name, what)  # noqa: E731
    busy = spec.lending.scoring if spec.lending is not None else contextlib.nullcontext  # no borrowing while it scores

    def score(item: ToScore) -> None:
        try:
            with busy(), timeline.span("score", group=item.index):
                rollouts = env.score_groups([tasks[item.task_index]], [item.completions])[0]
                progress(f"scored group {item.index}")
                for attempt in range(cfg.pipeline.infra_retries):  # an outage is retried, never trained on
                    if not all(r.is_infra_failure for r in rollouts) or item.index in cancelled or spec.stop.is_set():
                        break
                    spec.stop.wait(min(2.0**attempt, INFRA_BACKOFF_MAX_S))
                    rollouts = env.score_groups([tasks[item.task_index]], [item.completions])[0]
                    progress(f"scored group {item.index} again after an infrastructure failure (retry {attempt + 1})")
            fault_point("environment", "score")
            if item.index in cancelled:
                _pass_on(item.gen_stats, spec.outbox, spec.stop, beat)
                return
            _put(
                spec.outbox,
                Scored(
                    Group(index=item.index, task_index=item.task_index, born=item.born, rollouts=tuple(rollouts)),
                    item.gen_stats,
                ),
                spec.stop,
                beat,
            )
        except BaseException:
            failures.append(traceback.format_exc())
        finally:
            slots.release()

    def take_cancellations() -> None:
        while True:
            try:
                cancelled.update(spec.inbox.get_nowait().indices)
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
                    item = _take(groups, timeout=0.1)
                except queue.Empty:
                    slots.release()
                    continue
                take_cancellations()
                if item.index in cancelled:
                    _pass_on(item.gen_stats, spec.outbox, spec.stop, beat)
                    slots.release()
                    continue
                pool.submit(score, item)
            if failures:
                spec.outbox.put(ActorError(spec.name, failures[0]))
        finally:
            env.close()
            timeline.close()


def _episode_loop(spec: ActorSpec, env, tasks) -> None:
    """The environment of a multi-turn task: runs the episodes (episode_runner.py), sampling
    their turns on the replicas, and sends each finished group to the trainer."""
    from gapless.models import load_encoder
    from gapless.orchestrate.episode_runner import EpisodeRunner

    cfg, beat = spec.cfg, (lambda: spec.heartbeats.beat(spec.name))
    encoder = load_encoder(spec.policy_dir)
    encoder.keep(task.prompt for task in tasks)  # a task's prompt encoded once, not per group
    runner = EpisodeRunner(
        env,
        tasks,
        encoder,
        cfg.generator.group_size,
        cfg.pipeline.turn_schedule,
        send_turns=lambda replica, turns: _put(spec.to_generators[replica], NextTurns(turns), spec.stop, beat),
        send_scored=lambda group: _put(spec.outbox, Scored(group), spec.stop, beat),
        suspend=cfg.pipeline.suspend_between_turns,
        max_state_staleness=cfg.pipeline.max_env_state_staleness,
        on_stale=cfg.pipeline.env_state_stale,
        resume_after_s=cfg.pipeline.resume_after_s,
        progress=lambda what: spec.heartbeats.progress(spec.name, what),
    )
    messages: queue.Queue = queue.Queue()
    for i, source in enumerate(spec.from_generators):
        threading.Thread(target=_read_into, args=(source, messages), name=f"read-replica-{i}", daemon=True).start()
    spec.heartbeats.progress(spec.name, "set up: environment ready")
    spec.outbox.put(Ready(spec.name))
    try:
        while not spec.stop.is_set() and not runner.failures:
            beat()
            while True:
                try:
                    runner.cancel(spec.inbox.get_nowait().indices)
                except queue.Empty:
                    break
            try:
                runner.handle(_take(messages, timeout=POLL_S))
                while True:  # everything that arrived, before acting on the results
                    runner.handle(_take(messages))
            except queue.Empty:
                pass
            runner.poll()
        if runner.failures:
            spec.outbox.put(ActorError(spec.name, runner.failures[0]))
    finally:
        runner.close()
        env.close()
