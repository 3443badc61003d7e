"""The simulated pipeline: the real admission, buffer, partial-rollout and curriculum code on a
simulated clock, with cost models in place of the engine, the sandbox and the optimizer.

    Dispatcher ──groups──> Replica x R ──> environment (W workers) ──> StalenessBuffer
    (orchestrate/dispatch.py) (engine.py) (cpu on the pool + wait)   (orchestrate/buffer.py)
          ^     freed places on every drop, the born-stale guard as the real trainer sets it  │
          └──────── weights (version v+1) after the relay time  <── trainer step (Work) ───────┘

What is real (imported, not re-implemented): the trainer's `Dispatcher` over `Admission` (how
many groups may be in flight, and the born-stale guard; the simulated replicas share one weight
version, so the dispatcher sees them as one replica and the simulator spreads its groups),
`PromptSource` and `PassRateCurriculum` (which task each group gets, fed with the group's
rewards), `sampling_params` (which groups are synthetic stragglers), `StalenessBuffer` (when a
batch is ready, what is taken, what is cut or dropped and why), `PartialRollouts` (the time
deadline, on the simulated clock), the ledger's event records, and the trainer's drop handling
(each drop frees a place; the dispatcher's guard decides when a backfill may be born), and the
trainer's inbox discipline: it handles scored groups only while it waits in take(), so those
arriving while it trains or publishes wait, and a batch already ready at take() is trained at
once with them still queued; the replicas' Loaded messages likewise, unless
`pipeline.admit_while_training` resolves to 'on' (the default where the trainer does not borrow
the generator's cores), when they are handled on arrival and the groups a new version allows
are generated during the step (with 'off' nothing born at the new version is admitted until the
next wait: what makes a budget-1 trainer idle); `simulate.trainer_inbox = 'continuous'` handles
every message on arrival (a rollout controller that admits on its own).
What is modelled: generation (engine.py), scoring and training durations (costs.py), rewards
(each task has a pass probability drawn uniformly from [0, 1]; a rollout passes with it), and
sharing of the cores (pool.py). `reference_loop` simulates the one-process reference loop
instead: generation, then scoring of the whole step, then training, each with every core.
Guaranteed: the ledger and staleness invariants are those of the real buffer (tested with
`check_ledger`); a simulation is deterministic for a config, costs and seed.
Not guaranteed: evaluation, checkpoints and actor start-up are not simulated; the environment's
outbound queue is unbounded (the real one holds 2 P groups); a training step costs the same for
the same tokens, so where real rounds switch between two rhythms (bursts and a trickle) within a
round, one simulation keeps to one of them (docs/simulator.md).
"""

from __future__ import annotations

import os
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from gapless.config import Config
from gapless.orchestrate.admission import Admission, PromptSource, sampling_params
from gapless.orchestrate.buffer import StalenessBuffer
from gapless.orchestrate.dispatch import Dispatcher
from gapless.orchestrate.partial import PartialRollouts
from gapless.simulate.clock import EventLoop
from gapless.simulate.costs import Costs
from gapless.simulate.engine import PartialView, Replica, SimGroup
from gapless.simulate.pool import DedicatedPool, SharedPool, Work
from gapless.trainer.micro_batches import padded_tokens
from gapless.types import Completion, Group, Rollout


class SimScoredGroup(Group):
    """The real buffer's record, with what a simulated group knows when it is built: the oldest
    token version (its G rollouts share one completion record) and that no rollout failed in the
    infrastructure, so the buffer's per-step checks need not scan the rollouts again."""

    def __init__(self, index: int, task_index: int, born: int, rollouts: list, oldest: int):
        super().__init__(index=index, task_index=task_index, born=born, rollouts=tuple(rollouts))
        object.__setattr__(self, "_oldest", oldest)  # the record is frozen

    @property
    def oldest_version(self) -> int:
        return self._oldest

    @property
    def is_infra_failure(self) -> bool:
        return False


class NullLedger:
    """A ledger that writes nowhere (the buffer's `ledger` seam) but counts events by kind."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def write(self, event) -> None:
        self.counts[event.event] = self.counts.get(event.event, 0) + 1

    def close(self) -> None:
        pass


@dataclass
class StepRecord:
    step: int
    end_s: float
    step_s: float
    waited_s: float
    train_s: float
    push_s: float
    generator_idle_frac: float
    gen_tokens_per_s: float
    staleness: dict[int, int]  # staleness -> rollouts trained at it
    reward_mean: float
    length_mean: float
    truncated_frac: float
    trained_tokens: int
    drops: dict[str, int]  # cumulative, by reason
    partial_cuts: int
    gen_busy_s: float = 0.0  # per replica, in this step's window
    score_s: float = 0.0  # mean scoring time of the groups scored in this step's window


@dataclass
class SimResult:
    steps: list[StepRecord]
    sim_s: float
    samples_per_step: int
    spans: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)  # lane -> spans
    drops: dict[str, int] = field(default_factory=dict)
    events: int = 0

    def measured(self) -> list[StepRecord]:
        """Steps 2..S, as bench/pipeline.py measures (its step 1 includes starting the actors)."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    def summary(self) -> dict[str, float]:
        steps = self.measured()
        total = sum(r.step_s for r in steps)
        staleness: Counter[int] = Counter()
        for r in steps:
            staleness.update(r.staleness)
        rollouts = sum(staleness.values())
        return {
            "s_per_sample": total / max(len(steps) * self.samples_per_step, 1),
            "samples_per_s": len(steps) * self.samples_per_step / max(total, 1e-12),
            "trainer_idle_frac": sum(r.waited_s for r in steps) / max(total, 1e-12),
            "generator_idle_frac": sum(r.generator_idle_frac * r.step_s for r in steps) / max(total, 1e-12),
            "staleness_mean": sum(k * n for k, n in staleness.items()) / max(rollouts, 1),
            # a group's scoring span (its worker's wait and CPU; the reference loop: a step's scoring phase)
            "score_span_s": sum(r.score_s for r in steps) / max(sum(r.score_s > 0 for r in steps), 1),
            "staleness_max": float(max(staleness, default=0)),
            "sim_s": self.sim_s,
            **{f"drops/{k}": float(v) for k, v in sorted(self.drops.items())},
        }


def resolved_threads(cfg: Config, cores: int) -> tuple[int, int]:
    """(generator, trainer) threads as the real pipeline resolves them, for a machine of `cores`."""
    pl = cfg.pipeline
    if cfg.simulate.reference_loop:
        return cores, cores
    gen = pl.generator_threads or (cores if pl.max_staleness == 0 else max(1, cores // 2))
    trainer = pl.trainer_threads or (cores if pl.max_staleness == 0 else max(1, cores - gen))
    return gen, trainer


class Simulation:
    def __init__(self, cfg: Config, costs: Costs, ledger=None, timeline_steps: int | None = None):
        sim, pl = cfg.simulate, cfg.pipeline
        self.cfg, self.costs = cfg, costs
        self.P, self.G, self.s = cfg.loop.prompts_per_step, cfg.generator.group_size, pl.max_staleness
        self.steps = sim.steps or cfg.loop.steps
        self.cap_tokens = cfg.generator.max_new_tokens
        self.reference = sim.reference_loop
        self.loop = EventLoop()
        self.rng = random.Random(f"{cfg.seed}-simulate")
        self.shared = sim.placement == "shared"
        cores = sim.cores or os.cpu_count() or 2
        self.pool = SharedPool.for_costs(cores, costs) if self.shared else DedicatedPool()
        self.gen_threads, self.trainer_threads = resolved_threads(cfg, cores) if self.shared else (1, 1)
        self.lends = self.shared and self.s > 0 and pl.lend_idle_cores and not self.reference
        self.lend_while_scoring = pl.lend_while_scoring  # else the trainer lends only while no group is being scored
        uids = [f"task-{i}" for i in range(cfg.task.num_train_prompts)]
        task_rng = random.Random(f"{cfg.seed}-tasks")
        self.pass_rate = [task_rng.random() for _ in uids]
        self.uids = uids
        self.source = PromptSource(cfg.seed, uids, self.P, pl.curriculum)
        self.admission = Admission(self.P, self.s, pl.oversample)
        self.dispatcher = Dispatcher(self.admission, self.source)
        self.ledger = ledger if ledger is not None else NullLedger()
        self.buffer = StalenessBuffer(self.P, self.s, pl.oversample > 0, self.ledger, pl.dynamic_sampling, uids)
        self.partial = PartialRollouts(0, pl.partial_rollout_s, clock=self.loop.clock)
        replicas = sim.replicas if not self.reference else 1
        cap = self.gen_threads / replicas  # shared: the generator's threads (or devices) split among its replicas
        self.replicas = [
            Replica(
                r,
                self.loop,
                self.pool,
                cap,
                costs.generation,
                costs.prompt_tokens,
                cfg.generator.max_batch,
                self._generated,
                self._replica_busy,
            )
            for r in range(replicas)
        ]
        self.views = [PartialView(r) for r in self.replicas]
        self.where: dict[int, Replica] = {}  # group index -> its replica
        self.gen_version = 0
        self.workers = min(pl.env_workers, cfg.sandbox.concurrency)
        # the threads the scoring counts for on a shared pool: its programs, less the share of them blocked
        runnable = costs.sandbox_runnable if self.shared else 1.0
        self.score_cap = min(self.G, cfg.sandbox.concurrency) * runnable
        self.sandbox_slots = cfg.sandbox.concurrency * runnable  # shared by every group being scored
        self.cpu_works: list[Work] = []  # the groups in their CPU phase
        self.env_queue: deque[SimGroup] = deque()
        self.scoring = 0
        self.free_workers = list(range(self.workers - 1, -1, -1))
        self.score_sum, self.score_n, self.score_mark = 0.0, 0, (0.0, 0)
        self.busy_mark = 0.0
        self.version = 0  # trainer's policy version = steps done
        self.training = False  # training or publishing: messages to the trainer wait in its inbox
        self.inbox: deque = deque()
        self.continuous = self.reference or sim.trainer_inbox == "continuous"  # no inbox: handled on arrival
        self.admit_on_loaded = pl.admit_while_training_resolved(lending=self.lends)  # as the real trainer
        self.work: Work | None = None
        self.wait_start = 0.0
        self.last_end = 0.0
        self.idle_mark = 0.0
        self.tokens_mark = 0.0
        self.cuts = 0
        self.partial_token: int | None = None
        self.lengths_of: dict[int, list[int]] = {}  # scored groups' response lengths
        self.records: list[StepRecord] = []
        self.timeline_steps = sim.timeline_steps if timeline_steps is None else timeline_steps
        self.spans: dict[str, list[tuple[str, float, float]]] = {"trainer": []}
        self.events = 0
        for r in self.replicas:
            r.record_spans = self.timeline_steps > 0

    # ---- generator side -------------------------------------------------------------------
    def _pick_replica(self) -> Replica:
        if len(self.replicas) == 1:
            return self.replicas[0]
        n = len(self.replicas)  # two random choices: near-balanced load at O(1)
        a, b = self.replicas[self.rng.randrange(n)], self.replicas[self.rng.randrange(n)]
        return a if a.load() <= b.load() else b

    def _admit(self) -> None:
        if self.version >= self.steps:
            return
        self.dispatcher.loaded(0, self.gen_version)
        for index, task, born in self.dispatcher.assign().get(0, ()):
            params = sampling_params(self.cfg, index)
            if params.ignore_eos:
                lengths = [self.cap_tokens] * self.G
            else:
                lengths = self.costs.lengths.sample(self.rng, self.cap_tokens, self.G)
            group = SimGroup(index, task, born, lengths)
            self.buffer.admitted(index, born, task)
            replica = self._pick_replica()
            self.where[index] = replica
            replica.add(group)
        self._arm_partial()

    def _arm_partial(self) -> None:
        """Wake up at the earliest partial-rollout deadline, so a cut happens on time."""
        if not self.partial.enabled:
            return
        for view in self.views:
            self.cuts += len(self.partial.cut(view, lambda rid: sampling_params(self.cfg, int(rid))))
        self.loop.cancel(self.partial_token)
        self.partial_token = None
        future = [
            since + self.partial.deadline_s
            for since in self.partial.running_since.values()
            if since + self.partial.deadline_s > self.loop.now
        ]
        if future and self.version < self.steps:  # a deadline already past waits for a queue change
            self.partial_token = self.loop.at(min(future), self._partial_tick)

    def _partial_tick(self) -> None:
        self.partial_token = None
        self._arm_partial()

    def _replica_busy(self, rid: int, busy: bool) -> None:
        self._lending_changed()

    def _lending_changed(self) -> None:
        if self.lends and self.work is not None and not self.work.finished:
            self.work.set_cap(self._trainer_cap())

    def _trainer_cap(self) -> float:
        """The trainer's threads: the generator's too while no replica decodes and (unless
        pipeline.lend_while_scoring) no group is being scored, as orchestrate/lending.py lends them."""
        if self.lends and not any(r.is_busy for r in self.replicas) and (self.lend_while_scoring or not self.scoring):
            return self.trainer_threads + self.gen_threads
        return self.trainer_threads

    # ---- environment ----------------------------------------------------------------------
    def _generated(self, group: SimGroup) -> None:
        self.events += 1
        self.where.pop(group.index, None)
        self.env_queue.append(group)
        self._score_next()
        self._arm_partial()  # groups that just got a slot start their deadline now

    def _score_next(self) -> None:
        if self.reference and any(r.running or r.waiting for r in self.replicas):
            return  # the reference loop scores the step's groups once all are generated
        while self.env_queue and self.scoring < self.workers:
            group = self.env_queue.popleft()
            self.scoring += 1
            self._lending_changed()
            worker = self.free_workers.pop()
            wait = self.cfg.task.score_delay_s + self.costs.env.sample_wait(self.rng)
            self.loop.after(wait, lambda g=group, w=worker, t=self.loop.now: self._score_cpu(g, w, t))

    def _score_cpu(self, group: SimGroup, worker: int, start: float) -> None:
        cpu = self.costs.env.sample_cpu(self.rng)
        if cpu <= 0:
            self._scored(group, worker, start)
        elif self.shared:
            # a group's G programs run on the environment's one sandbox pool: sandbox.concurrency
            # programs at once over every group in its CPU phase, at most G for one group
            work = Work(self.loop, self.pool, self.score_cap, cpu, lambda: self._cpu_done(work, group, worker, start))
            self.cpu_works.append(work)
            self._share_sandbox()
        else:
            self.loop.after(cpu, lambda: self._scored(group, worker, start))

    def _cpu_done(self, work, group: SimGroup, worker: int, start: float) -> None:
        self.cpu_works.remove(work)
        self._share_sandbox()
        self._scored(group, worker, start)

    def _share_sandbox(self) -> None:
        cap = min(self.score_cap, self.sandbox_slots / max(len(self.cpu_works), 1))
        for work in self.cpu_works:
            work.set_cap(cap)

    def _scored(self, group: SimGroup, worker: int, start: float) -> None:
        self.scoring -= 1
        self._lending_changed()
        self.free_workers.append(worker)
        self.score_sum += self.loop.now - start
        self.score_n += 1
        self._span(f"env-{worker}", "score", start, self.loop.now, self.version)
        p = self.pass_rate[group.task_index]
        oldest = group.oldest if group.oldest is not None else group.born
        completion = Completion([], [], [], [oldest], "stop", "")
        uid = self.uids[group.task_index]
        passed, failed = Rollout(uid, completion, 1.0, "ok"), Rollout(uid, completion, 0.0, "wrong_answer")
        rollouts = self.rng.choices((passed, failed), cum_weights=(p, 1.0), k=self.G)  # the group's G rollouts
        scored = SimScoredGroup(group.index, group.task_index, group.born, rollouts, oldest)
        self.lengths_of[group.index] = group.lengths  # for the step's token count and length metrics
        if self.continuous:  # handled on arrival, before the worker takes the next group
            self._arrived(group, rollouts, scored)
            self._score_next()
            self._try_step()
        else:
            self._score_next()
            self._deliver(lambda: self._arrived(group, rollouts, scored))

    def _arrived(self, group: SimGroup, rollouts: list, scored: SimScoredGroup) -> None:
        """The trainer handles a Scored message: buffer, curriculum, dispatcher."""
        self.dispatcher.scored(group.index)
        if group.index not in self.buffer.closed:
            self.source.feedback(self.uids[group.task_index], [r.reward for r in rollouts])
        reason = self.buffer.arrived(scored)
        if reason is not None:  # a drop frees a place; the dispatcher's guard keeps a backfill from being due too early
            self.admission.freed(1)
            self._admit()

    # ---- the trainer's inbox ---------------------------------------------------------------
    def _deliver(self, handle) -> None:
        """A message to the trainer (a scored group; a replica's Loaded unless admitted on arrival):
        as in the real pipeline, the trainer handles it only while it waits in take(); those
        arriving while it trains or publishes wait in its inbox until its next take() finds the
        batch not ready (trainer_inbox 'take'; 'continuous' handles them where they arise)."""
        if not self.training:
            handle()
            self._try_step()
        else:
            self.inbox.append(handle)

    def _take(self) -> None:
        """take(): train at once if the batch is ready; else handle queued messages until it is."""
        while self.inbox and not self._batch_ready():
            self.inbox.popleft()()
        self._try_step()

    def _batch_ready(self) -> bool:
        return len(self.buffer.ready) >= self.P and self.buffer.is_batch_ready(self.version)

    def _loaded(self, version: int) -> None:
        """The replicas report `version` loaded: groups born at it may be admitted."""
        self.gen_version = max(self.gen_version, version)
        self._admit()

    # ---- trainer --------------------------------------------------------------------------
    def _try_step(self) -> None:
        if self.training or self.version >= self.steps or not self._batch_ready():
            return
        step = self.version
        now = self.loop.now
        waited = now - self.wait_start
        drops_before = self.buffer.num_dropped
        groups, cut = self.buffer.take(step)
        if cut:
            for index in cut:
                self.dispatcher.scored(index)  # cut: no longer held
                replica = self.where.pop(index, None)
                if replica is not None:
                    replica.abort([index])
            cut_set = set(cut)
            self.env_queue = deque(g for g in self.env_queue if g.index not in cut_set)
        self.admission.freed(self.buffer.num_dropped - drops_before)
        self.admission.assembling(step + 1)  # a backfill born now must not be due before the next step
        lengths = [self.lengths_of.pop(g.index) for g in groups]
        for index in [i for i in self.lengths_of if i in self.buffer.closed]:
            del self.lengths_of[index]  # dropped after scoring
        tokens = sum(self.costs.prompt_tokens * self.G + sum(n) for n in lengths)
        padded = padded_tokens(
            [self.costs.prompt_tokens + n for group in lengths for n in group], self.cfg.trainer.micro_batch_size
        )  # what the forward and backward passes compute
        cost = self.costs.trainer
        self.training = True
        train_start = now

        def trained() -> None:
            push_s = self.costs.relay.push_s
            train_s = self.loop.now - train_start
            self._span("trainer", "train", train_start, self.loop.now, step)
            self.loop.after(push_s, lambda: self._published(step, groups, lengths, waited, train_s, push_s, tokens))

        self._span("trainer", "wait_rollouts", self.wait_start, now, step)
        ranks = 1 if self.shared else self.cfg.simulate.trainer_ranks  # split: data parallel over the ranks
        self.work = Work(
            self.loop, self.pool, self._trainer_cap(), cost.step_s + cost.token_s * padded / ranks, trained, team=True
        )

    def _published(self, step, groups, lengths, waited, train_s, push_s, tokens) -> None:
        now = self.loop.now
        self._span("trainer", "weight_push", now - push_s, now, step)
        self.version = step + 1
        self.training = False
        if self.continuous:
            self.gen_version = self.version
        for replica in self.replicas:
            replica.update_weights(self.version, push_s)
        idle = sum(r.idle_s for r in self.replicas)
        gen_tokens = sum(r.tokens for r in self.replicas)
        step_s = now - self.last_end
        window = max(step_s, 1e-12) * len(self.replicas)
        self.records.append(
            StepRecord(
                step,
                now,
                step_s,
                waited,
                train_s,
                push_s,
                (idle - self.idle_mark) / window,
                (gen_tokens - self.tokens_mark) / max(step_s, 1e-12),
                dict(Counter(step - g.oldest_version for g in groups for _ in g.rollouts)),
                sum(r.reward for g in groups for r in g.rollouts) / (len(groups) * self.G),
                sum(map(sum, lengths)) / (len(groups) * self.G),
                sum(n >= self.cap_tokens for group in lengths for n in group) / (len(groups) * self.G),
                tokens,
                dict(self.buffer.drops),
                self.cuts,
            )
        )
        record = self.records[-1]
        busy = sum(r.busy_s for r in self.replicas)
        record.gen_busy_s = (busy - self.busy_mark) / len(self.replicas)
        scored = self.score_n - self.score_mark[1]
        record.score_s = (self.score_sum - self.score_mark[0]) / scored if scored else 0.0
        self.busy_mark, self.score_mark = busy, (self.score_sum, self.score_n)
        if self.reference:
            record.waited_s = step_s - train_s  # the reference loop: trainer idle = not training
        self.idle_mark, self.tokens_mark, self.last_end, self.wait_start = idle, gen_tokens, now, now
        if self.version >= self.steps:
            return
        if self.timeline_steps and self.version == self.timeline_steps:
            for r in self.replicas:
                r.close_spans()
                r.record_spans = False
        if self.continuous:
            self._admit()
            self._try_step()
            return
        # the replicas' Loaded(version) reaches the trainer just after it looked at its buffer (same
        # instant, next event); with admit_while_training it is handled on arrival, training or not
        if self.admit_on_loaded:
            self.loop.after(0.0, lambda v=self.version: self._loaded(v))
        else:
            self.loop.after(0.0, lambda v=self.version: self._deliver(lambda: self._loaded(v)))
        self._take()

    def _span(self, lane: str, name: str, start: float, end: float, step: int) -> None:
        if step < self.timeline_steps:
            self.spans.setdefault(lane, []).append((name, start, end))

    # ---- run ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._admit()
        horizon = 1e6 * max(self.steps, 1) * max(self.costs.trainer.step_s + 1.0, 1.0)
        self.loop.run(until=lambda: self.version >= self.steps, max_time_s=horizon)
        if self.version < self.steps:
            raise RuntimeError(
                f"the simulation stopped at step {self.version} of {self.steps} with no event left: "
                "nothing was admitted or scored (check loop.prompts_per_step and the costs)"
            )
        self.buffer.close(self.version)
        self.ledger.close()
        spans = dict(self.spans)
        for r in self.replicas:
            if r.spans:
                spans[f"generator-{r.rid}"] = r.spans
        return SimResult(self.records, self.loop.now, self.P * self.G, spans, dict(self.buffer.drops), self.events)
