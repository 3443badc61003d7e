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
staleness t - (oldest token version) <= max_staleness; `take` asserts it for each group, with the
staleness counted from the oldest policy version among its tokens. Admission (admission.py) keeps
the due groups of a step within one batch, so the rule never asks for more than P + extra.
Dynamic sampling drops zero-variance groups on arrival ('zero_variance'), and groups whose every
rollout failed in the infrastructure ('infra_error'); each drop frees a place for a backfill.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gapless.types import Rollout


@dataclass
class ScoredGroup:
    index: int  # admission order
    task_index: int
    born: int  # policy version when admitted
    rollouts: list[Rollout]

    @property
    def oldest_version(self) -> int:
        return min(r.completion.oldest_version for r in self.rollouts)

    @property
    def is_zero_variance(self) -> bool:
        rewards = {r.reward for r in self.rollouts if not r.is_infra_failure}
        return len(rewards) <= 1

    @property
    def is_infra_failure(self) -> bool:
        return all(r.is_infra_failure for r in self.rollouts)


class GroupLedger:
    """Append-only record of every group's admission and end ('trained' or 'dropped')."""

    def __init__(self, path: Path, append: bool = False):
        self._fh = open(path, "a" if append else "w")

    def write(self, index: int, event: str, **fields) -> None:
        self._fh.write(json.dumps({"group": index, "event": event, **fields}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class StalenessBuffer:
    def __init__(self, groups_per_step: int, max_staleness: int, cut_stragglers: bool, ledger: GroupLedger,
                 dynamic_sampling: bool = False):
        self.per_step, self.max_staleness = groups_per_step, max_staleness
        self.cut_stragglers, self.dynamic_sampling = cut_stragglers, dynamic_sampling
        self.ledger = ledger
        self.in_flight: dict[int, int] = {}  # index -> birth version: admitted, not yet scored
        self.ready: dict[int, ScoredGroup] = {}
        self.closed: set[int] = set()  # trained or dropped
        self.drops: dict[str, int] = {}  # reason -> count
        self.num_dropped = 0

    def admitted(self, index: int, born: int) -> None:
        if index in self.closed or index in self.ready or index in self.in_flight:
            return  # the scored group overtook its admission record
        self.in_flight[index] = born
        self.ledger.write(index, "admitted", born=born)

    def arrived(self, group: ScoredGroup) -> str | None:
        """File a scored group; returns the drop reason if it does not enter the buffer."""
        if group.index in self.closed:
            return None  # already dropped (cut as a straggler while its scoring was under way)
        self.admitted(group.index, group.born)
        self.in_flight.pop(group.index, None)
        if group.is_infra_failure:
            return self.drop(group.index, "infra_error")
        if self.dynamic_sampling and group.is_zero_variance:
            return self.drop(group.index, "zero_variance")
        self.ready[group.index] = group
        return None

    def drop(self, index: int, reason: str, step: int | None = None) -> str:
        self.in_flight.pop(index, None)
        self.ready.pop(index, None)
        self.closed.add(index)
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.num_dropped += 1
        self.ledger.write(index, "dropped", reason=reason, **({} if step is None else {"step": step}))
        return reason

    def due(self, step: int) -> list[int]:
        last_born = step - self.max_staleness
        return [i for i, born in self.in_flight.items() if born <= last_born] + \
               [i for i, g in self.ready.items() if g.born <= last_born]  # fmt: skip

    def is_batch_ready(self, step: int) -> bool:
        if len(self.ready) < self.per_step:
            return False
        last_born = step - self.max_staleness
        return self.cut_stragglers or all(born > last_born for born in self.in_flight.values())

    def take(self, step: int) -> tuple[list[ScoredGroup], list[int]]:
        """Step `step`'s groups (in admission order) and the in-flight groups cut as stragglers."""
        order = sorted(self.ready.values(), key=lambda g: (g.born, g.index))
        taken = sorted(order[: self.per_step], key=lambda g: g.index)
        for group in taken:
            staleness = step - group.oldest_version
            assert 0 <= staleness <= self.max_staleness, (
                f"group {group.index} would train at staleness {staleness} > max_staleness {self.max_staleness}")
            del self.ready[group.index]
            self.closed.add(group.index)
            rewards = [r.reward for r in group.rollouts if not r.is_infra_failure]
            self.ledger.write(group.index, "trained", step=step, staleness=staleness, rewards=rewards)
        cut = []
        for index in self.due(step):
            is_running = index in self.in_flight
            if is_running:
                cut.append(index)
            self.drop(index, "straggler" if is_running else "surplus", step)
        return taken, cut

    def close(self, step: int) -> None:
        """End of run: what is still admitted is dropped, so the ledger closes every group."""
        for index in list(self.in_flight) + list(self.ready):
            self.drop(index, "run_ended", step)
