"""The trainer's side of the staleness budget: which scored groups make up step t's batch.

Every admitted group is, exactly once, either trained or dropped with a reason; `GroupLedger`
writes each event to `groups.jsonl` in the run directory, so this is checkable after the fact.

A group is *due* at step t when its birth version b (the policy version when it was admitted)
satisfies b <= t - max_staleness: step t is the last one that may train it. The rule:

    step t's batch is ready when  P groups are ready  and  every due group is ready
                                  (with oversampling: P groups are ready; due stragglers are cut)
    take: the P ready groups of lowest birth version (due groups first), then drop what is due
          but was not taken (still generating: 'straggler'; scored but surplus: 'surplus')

By induction no group older than t - max_staleness is alive at step t, so every trained group has
staleness t - (oldest token version) <= max_staleness; `take` checks it for each group, with the
staleness counted from the oldest policy version among its tokens, and drops a group that would
break it ('over_budget', counted; never trained, never a crash) -- admission (the dispatcher's born-stale
guard, dispatch.py) is what keeps that from happening. Admission (admission.py) keeps
the due groups of a step within one batch, so the rule never asks for more than P + extra.
Dynamic sampling drops zero-variance groups on arrival ('zero_variance'), and groups whose every
rollout failed in the infrastructure ('infra_error'), or with an episode resumed past the
environment-state bound ('env_state_stale'); each drop frees a place for a backfill. A group with
suspended episodes carries `env_state` in its ledger events: per episode, the policy version that
last changed its sandbox state and the version that resumed it.
"""

from __future__ import annotations

from typing import Sequence

from gapless.orchestrate.ledger import GroupEvent, GroupLedger
from gapless.types import DropReason, Group

ENV_STATE_STALE = DropReason.ENV_STATE_STALE.value  # also an episode's status (episode_runner.py)


class StalenessBuffer:
    def __init__(
        self,
        groups_per_step: int,
        max_staleness: int,
        cut_stragglers: bool,
        ledger: GroupLedger,
        dynamic_sampling: bool = False,
        uids: Sequence[str] = (),
    ):
        self.per_step, self.max_staleness = groups_per_step, max_staleness
        self.cut_stragglers, self.dynamic_sampling = cut_stragglers, dynamic_sampling
        self.ledger = ledger
        self.uids = list(uids)  # task index -> prompt uid, for the ledger
        self.task_of: dict[int, int] = {}  # index -> task index of every open group
        self.in_flight: dict[int, int] = {}  # index -> birth version: admitted, not yet scored
        self.ready: dict[int, Group] = {}
        self.closed: set[int] = set()  # trained or dropped
        self.drops: dict[str, int] = {}  # reason -> count
        self.num_dropped = 0

    def _uid(self, task_index: int | None) -> str | None:
        return self.uids[task_index] if task_index is not None and task_index < len(self.uids) else None

    def admitted(self, index: int, born: int, task_index: int | None = None) -> None:
        if index in self.closed or index in self.ready or index in self.in_flight:
            return  # the scored group overtook its admission record
        self.in_flight[index] = born
        if task_index is not None:
            self.task_of[index] = task_index
        self.ledger.write(GroupEvent(index, "admitted", uid=self._uid(task_index), born=born))

    def arrived(self, group: Group) -> str | None:
        """File a scored group; returns the drop reason if it does not enter the buffer."""
        if group.index in self.closed:
            return None  # already dropped (cut as a straggler while its scoring was under way)
        self.admitted(group.index, group.born, group.task_index)
        self.in_flight.pop(group.index, None)
        if group.is_infra_failure:
            return self.drop(group.index, DropReason.INFRA_ERROR, group=group)
        if any(r.status == ENV_STATE_STALE for r in group.rollouts):  # resumed past pipeline.max_env_state_staleness
            return self.drop(group.index, DropReason.ENV_STATE_STALE, group=group)
        if self.dynamic_sampling and group.is_zero_variance:
            return self.drop(group.index, DropReason.ZERO_VARIANCE, group=group)
        self.ready[group.index] = group
        return None

    def drop(self, index: int, reason: DropReason, step: int | None = None, group: Group | None = None) -> str:
        born = self.in_flight.pop(index, None)
        group = self.ready.pop(index, None) or group
        self.closed.add(index)
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.num_dropped += 1
        self.ledger.write(self._event(index, "dropped", step, group, reason=reason, born=born))
        self.task_of.pop(index, None)
        return reason

    def _event(self, index: int, kind: str, step: int | None, group: Group | None, **fields) -> GroupEvent:
        if group is None:
            return GroupEvent(index, kind, uid=self._uid(self.task_of.get(index)), step=step, **fields)
        fields["born"] = group.born
        states = [[r.info.get("env_state_version"), r.info.get("resumed_by_version")] for r in group.rollouts]
        if any(v is not None for pair in states for v in pair):  # suspended and resumed episodes
            fields["extra"] = {
                "env_state": states
            }  # per episode: [version that last wrote its state, version that resumed it]
        return GroupEvent(
            index,
            kind,
            uid=self._uid(group.task_index),
            step=step,
            oldest_version=group.oldest_version,
            rewards=[None if r.is_infra_failure else r.reward for r in group.rollouts],
            statuses=[r.status for r in group.rollouts],
            **fields,
        )

    def due(self, step: int) -> list[int]:
        last_born = step - self.max_staleness
        return [i for i, born in self.in_flight.items() if born <= last_born] + \
               [i for i, g in self.ready.items() if g.born <= last_born]  # fmt: skip

    def is_batch_ready(self, step: int) -> bool:
        if len(self.ready) < self.per_step:
            return False
        last_born = step - self.max_staleness
        return self.cut_stragglers or all(born > last_born for born in self.in_flight.values())

    def take(self, step: int) -> tuple[list[Group], list[int]]:
        """Step `step`'s groups (in admission order) and the in-flight groups cut as stragglers."""
        for group in list(self.ready.values()):  # never trained: a group admission let through too early
            if not 0 <= step - group.oldest_version <= self.max_staleness:
                self.drop(group.index, DropReason.OVER_BUDGET, step)
        order = sorted(self.ready.values(), key=lambda g: (g.born, g.index))
        taken = sorted(order[: self.per_step], key=lambda g: g.index)
        for group in taken:
            del self.ready[group.index]
            self.closed.add(group.index)
            self.task_of.pop(group.index, None)
            self.ledger.write(self._event(group.index, "trained", step, group, staleness=step - group.oldest_version))
        cut = []
        for index in self.due(step):
            is_running = index in self.in_flight
            if is_running:
                cut.append(index)
            self.drop(index, DropReason.STRAGGLER if is_running else DropReason.SURPLUS, step)
        return taken, cut

    def close(self, step: int, reason: str = "run_ended") -> None:
        """End of run (`reason`: run_ended, run_stopped, run_failed): what is still admitted is
        dropped, so the ledger closes every group of the segment."""
        for index in list(self.in_flight) + list(self.ready):
            self.drop(index, DropReason(reason), step)
