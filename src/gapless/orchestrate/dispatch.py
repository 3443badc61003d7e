"""Central admission: which generator replica starts which group, decided in the trainer process.

With R generator replicas (`cluster.replicas`), admission cannot live in a generator: the
staleness budget and the backfills are one count over all of them. The `Dispatcher` holds the
run's `Admission` and `PromptSource` (admission.py) and each replica's policy version as the
replica last reported it (messages.Loaded), and hands out groups (messages.Assign), each born at
the newest version a replica reports, n:

    a group is admitted  iff  Admission.may_admit(n)  (the count, and n >= min_birth)
    it goes to the replica holding the fewest among those at version n or n - 1

`min_birth` (kept by Admission, with the count) is the born-stale guard: a group born at v is
due at step v + max_staleness, which must not be before the step the trainer is assembling. A replica one version behind starts its
groups once it has loaded version n (already published: another replica holds it); one further
behind gets no new groups until it loads newer weights (it finishes what it holds). Groups go to
the replica holding the fewest, lowest replica index first; with one replica this reproduces the
generator-side admission exactly (same indices, tasks, seeds and birth versions: budget 0 equals
the reference loop bitwise). Freed places (drops) count at once: the guard, not the drop, decides
when a backfill may be born.

Guaranteed: every index is assigned once, to one replica; `lost(r)` returns exactly the groups
assigned to replica r that have not been scored (the trainer drops them as `replica_lost`; a
score that still arrives for one is ignored by the buffer). Not guaranteed: balance by work (a
replica's groups may be longer than another's).
"""

from __future__ import annotations

from collections import defaultdict

from gapless.orchestrate.admission import Admission, PromptSource
from gapless.types import Admitted


class Dispatcher:
    def __init__(self, admission: Admission, prompts: PromptSource):
        self.admission, self.prompts = admission, prompts  # the budget is the admission's alone
        self.versions: dict[int, int] = {}  # replica -> the policy version it last reported holding
        self.holder: dict[int, int] = {}  # group index -> replica, until scored or lost
        self.held: dict[int, set[int]] = defaultdict(set)  # replica -> group indices

    def loaded(self, replica: int, version: int) -> None:
        self.versions[replica] = max(version, self.versions.get(replica, version))

    def assign(self) -> dict[int, list[Admitted]]:
        """Hand out every group admission allows now: replica -> [(index, task index, born)]."""
        out: dict[int, list[Admitted]] = defaultdict(list)
        if not self.versions:
            return {}
        born = max(self.versions.values())  # the newest version any replica holds (it is published)
        # the replicas holding it or the one before take the groups born at it, fewest held first:
        # one a version behind starts them once it has loaded it (actors.py), so a new version's
        # groups are shared instead of all going to the replica whose Loaded was read first
        takers = [r for r, v in self.versions.items() if v >= born - 1]
        while self.admission.may_admit(born):
            replica = min(takers, key=lambda r: (len(self.held[r]), r))
            index = self.admission.admit()
            self.holder[index] = replica
            self.held[replica].add(index)
            out[replica].append(Admitted(index, self.prompts.task_for(index), born))
        return dict(out)

    def scored(self, index: int) -> None:
        replica = self.holder.pop(index, None)
        if replica is not None:
            self.held[replica].discard(index)

    def lost(self, replica: int) -> list[int]:
        """Replica `replica` is gone: forget it and return the groups it held."""
        self.versions.pop(replica, None)
        indices = sorted(self.held.pop(replica, set()))
        for index in indices:
            self.holder.pop(index, None)
        return indices
