"""One generator replica on the simulated clock: continuous batching at the granularity of groups.

A replica decodes its running groups together; a decode step costs `step_s + row_s * rows`
(costs.GenerationCost) at the replica's speed (pool.py). Between two events the batch does not
change, so the replica's decode-step counter advances linearly and the next event is the
earliest group to finish: a few events per group, not one per token, which is what lets a
1,000-GPU run of 10,000 steps finish in seconds.

    waiting groups ──(G slots free: sequences still running + G <= max_batch)──> running groups
                        prefill (prompt and already generated tokens) pauses the replica
    running group ends after max(remaining lengths) steps ──> on_finished(group)

A running sequence holds its slot until it ends, as in the real engine, so a waiting group starts
at the decode step when enough of the running sequences have ended for all of its own (one event
per waiting group, at the step computed from the running sequences' lengths). The real engine
starts each waiting sequence as soon as one slot frees, so it starts a group's sequences a few
steps earlier than this. Either way a short group admitted later often ends before an earlier
group's longest sequence (so at budget 1 a step's last group can be scored after most of the
next step's).
Approximation (stated in docs/simulator.md): for the decode step's cost a group counts as
`sum(remaining) / max(remaining)` rows over its whole life (its mean occupancy). Throughput with
a cost linear in rows is exact; the tail of a heavy-tailed group is spread over its life. A
weight update pauses the replica for the relay time; groups in flight keep decoding (their oldest
token keeps its version), as in the real generator. `PartialView` exposes the replica to the real
`orchestrate.partial.PartialRollouts`.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from gapless.simulate.clock import EventLoop
from gapless.simulate.costs import GenerationCost


@dataclass
class SimGroup:
    index: int  # admission order
    task_index: int
    born: int  # policy version when admitted
    lengths: list[int]  # response length of each of its G sequences
    done: list[int] = field(default_factory=list)  # tokens generated so far, per sequence
    oldest: int | None = None  # policy version of its first token
    cuts: int = 0

    def __post_init__(self) -> None:
        if not self.done:
            self.done = [0] * len(self.lengths)


def _remaining(group: SimGroup) -> list[int]:
    return [max(n - d, 0) for n, d in zip(group.lengths, group.done)]


def _sequences(remaining: list[int]) -> int:
    """The slots a group takes when it starts: its unfinished sequences (at least one)."""
    return max(sum(1 for n in remaining if n > 0), 1)


def _occupancy(remaining: list[int]) -> float:
    """The rows a group keeps busy over its life, on average: sum(remaining) / max(remaining)."""
    return sum(remaining) / max(max(remaining), 1)


class Replica:
    def __init__(
        self,
        rid: int,
        loop: EventLoop,
        pool,
        cap: float,
        cost: GenerationCost,
        prompt_tokens: int,
        max_batch: int,
        on_finished: Callable[[SimGroup], None],
        on_busy: Callable[[int, bool], None],
    ):
        self.rid, self.loop, self.pool, self.cap, self.cost = rid, loop, pool, cap, cost
        self.prompt_tokens, self.max_batch = prompt_tokens, max_batch
        self.on_finished, self.on_busy = on_finished, on_busy
        self.version = 0
        self.waiting: deque[SimGroup] = deque()
        self.running: dict[
            int, tuple[SimGroup, float, float, int]
        ] = {}  # index -> (group, start step, end step, serial)
        self.ends: list[tuple[float, int]] = []  # heap of (end step, index), lazily cleaned
        self.k = 0.0  # decode steps done (fractional between events)
        self.rows = 0.0  # mean occupancy of the running groups: the rows a decode step costs
        self.seq_ends: list[tuple[float, int]] = []  # heap of (end step, admission serial), one per running sequence
        self.unreleased: dict[int, int] = {}  # serial of a running group -> its entries still in seq_ends
        self.held = 0  # slots held: entries of running groups not yet released
        self.serials = 0
        self.admit_k: float | None = None  # the decode step at which the waiting group's slots are free
        self.speed = 0.0
        self.paused_until = 0.0
        self.t_last = 0.0
        self.token: int | None = None
        self.is_busy = False
        self.busy_s = self.idle_s = self.stall_s = self.tokens = 0.0
        self.spans: list[tuple[str, float, float]] = []  # (name, start, end) when recording
        self.record_spans = False
        self._span_start = 0.0

    # ---- bookkeeping ----------------------------------------------------------------------
    def load(self) -> int:
        """Sequences here: the slots held and every waiting sequence."""
        return self.held + sum(len(g.lengths) for g in self.waiting)

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self.t_last
        if self.running:
            self.busy_s += dt
            start = max(self.t_last, self.paused_until)
            if now > start and self.speed > 0:
                steps = (now - start) * self.speed / self.cost.decode_step_s(self.rows)
                self.k += steps
                self.tokens += steps * self.rows
        elif dt > 0:
            self.idle_s += dt
        self.t_last = now

    def _reschedule(self) -> None:
        self.loop.cancel(self.token)
        self.token = None
        while self.ends and self.ends[0][1] not in self.running:
            heapq.heappop(self.ends)
        next_k = [k for k in (self.ends[0][0] if self.ends else None, self.admit_k) if k is not None]
        if not next_k or self.speed <= 0:
            return
        end_k = min(next_k)
        rate = self.speed / self.cost.decode_step_s(self.rows)
        start = max(self.loop.now, self.paused_until)
        self.token = self.loop.at(start + max(end_k - self.k, 0.0) / rate, self._finish_due)

    def _set_busy(self, busy: bool) -> None:
        if busy == self.is_busy:
            return
        self.is_busy = busy
        now = self.loop.now
        if self.record_spans:
            self.spans.append(("wait_weights" if busy else "generate", self._span_start, now))
        self._span_start = now
        if busy:
            # torch's decode threads: an OpenMP team; one thread or less: served first where the pool says so
            self.pool.start(self, self.cap, self.on_speed, team=True, first=True)
        else:
            self.pool.stop(self)
            self.speed = 0.0
        self.on_busy(self.rid, busy)

    def on_speed(self, speed: float) -> None:
        self._advance()
        self.speed = speed
        self._reschedule()

    def _pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, self.loop.now) + seconds

    # ---- work -----------------------------------------------------------------------------
    def add(self, group: SimGroup) -> None:
        self._advance()
        self.waiting.append(group)
        self._fill()

    def _tolerance(self) -> float:
        """Steps: float rounding of a long run's counter must not leave a sequence or a group a hair
        short of its end, re-firing at the same instant."""
        return 1e-6 + 1e-12 * self.k

    def _release(self) -> None:
        """Free the slots of the sequences that have ended by now."""
        while self.seq_ends and self.seq_ends[0][0] <= self.k + self._tolerance():
            _, serial = heapq.heappop(self.seq_ends)
            if serial in self.unreleased:  # else its group was cut: released then
                self.unreleased[serial] -= 1
                self.held -= 1

    def _fill(self) -> None:
        prefill_tokens = 0
        self._release()
        while self.waiting:
            remaining = _remaining(self.waiting[0])
            taken = _sequences(remaining)
            if self.running and self.held + taken > self.max_batch:
                break  # the next group waits: `remaining` and `taken` stay its own
            group = self.waiting.popleft()
            longest = max(max(remaining), 1)
            if group.oldest is None:
                group.oldest = self.version
            self.serials += 1
            self.running[group.index] = (group, self.k, self.k + longest, self.serials)
            heapq.heappush(self.ends, (self.k + longest, group.index))
            for n in remaining:
                if n > 0:
                    heapq.heappush(self.seq_ends, (self.k + n, self.serials))
            self.unreleased[self.serials] = taken
            self.held += taken
            self.rows += _occupancy(remaining)
            prefill_tokens += sum(self.prompt_tokens + d for d in group.done)
        self.admit_k = None
        if self.waiting:  # the step at which enough running sequences will have ended for the next group
            needed = self.held + taken - self.max_batch
            live = [k for k, serial in self.seq_ends if serial in self.unreleased]
            if 0 < needed <= len(live):
                self.admit_k = heapq.nsmallest(needed, live)[-1]
        if self.running:
            self._set_busy(True)
        if prefill_tokens and self.speed > 0:
            self._pause(self.cost.prefill_token_s * prefill_tokens / self.speed)
        self._reschedule()

    def _remove(self, index: int) -> SimGroup:
        group, start_k, _, serial = self.running.pop(index)
        self.rows -= _occupancy(_remaining(group))
        self.held -= self.unreleased.pop(serial, 0)
        if not self.running:
            self.rows, self.held, self.seq_ends, self.unreleased = 0.0, 0, [], {}
        steps = self.k - start_k
        group.done = [min(n, d + round(steps)) for n, d in zip(group.lengths, group.done)]
        return group

    def _finish_due(self) -> None:
        self.token = None
        self._advance()
        finished = []
        while self.ends and self.ends[0][0] <= self.k + self._tolerance():
            _, index = heapq.heappop(self.ends)
            if index in self.running:
                group = self._remove(index)
                group.done = list(group.lengths)
                finished.append(group)
        self._fill()
        if not self.running:
            self._set_busy(False)
        for group in finished:
            self.on_finished(group)

    def abort(self, indices) -> list[SimGroup]:
        """Stop groups (stragglers cut by the trainer); returns those that were here."""
        self._advance()
        wanted = set(indices)
        out = [g for g in self.waiting if g.index in wanted]
        if out:
            self.waiting = deque(g for g in self.waiting if g.index not in wanted)
        out += [self._remove(i) for i in list(self.running) if i in wanted]
        self._fill()
        if not self.running:
            self._set_busy(False)
        return out

    def requeue(self, index: int) -> None:
        """A partial rollout: stop the group now and queue it again at the back (re-prefilled)."""
        self._advance()
        if index in self.running:
            group = self._remove(index)
            group.cuts += 1
            self.waiting.append(group)
            self._fill()

    def update_weights(self, version: int, stall_s: float) -> None:
        self._advance()
        self.version = version
        if self.running and stall_s > 0:
            self.stall_s += stall_s
            self._pause(stall_s)
        self._reschedule()

    def close_spans(self) -> None:
        if self.record_spans:
            self.spans.append(("generate" if self.is_busy else "wait_weights", self._span_start, self.loop.now))
            self._span_start = self.loop.now


class _Seq:
    __slots__ = ("request_id", "tokens")

    def __init__(self, request_id: str):
        self.request_id, self.tokens = request_id, ()


class PartialView:
    """What `PartialRollouts.cut` touches of an engine (`running`, `num_waiting`, `abort`,
    `resume`), answered by a simulated replica. Only the time deadline is simulated: a group's
    token counts are not tracked between events."""

    def __init__(self, replica: Replica):
        self.replica = replica

    @property
    def running(self) -> list[_Seq]:
        return [_Seq(str(i)) for i in self.replica.running]

    @property
    def num_waiting(self) -> int:
        return len(self.replica.waiting)

    def abort(self, request_ids: list[str]) -> list[str]:
        return request_ids

    def resume(self, aborted: list[str], params, request_id: str) -> None:
        self.replica.requeue(int(request_id))
