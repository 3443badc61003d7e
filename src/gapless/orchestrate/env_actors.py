"""The run's environment actors: their slots, which one scores each admitted group, and what a
lost one held (`cluster.env_actors`, `cluster.env_restarts`).

Routing is decided in the trainer process when a group is admitted, like its replica
(dispatch.py): each group goes to the ready environment actor holding the fewest unscored groups
(lowest slot first; a replacement still starting gets groups only when no actor is ready), and its
replica sends the generated group to that actor's queue (messages.Assign.scorers). With one actor
every group goes to slot 0: today's pipeline.

Guaranteed: every routed index is held by exactly one slot until `scored` or `lost`; `lost(e)`
returns exactly the groups routed to slot e that were not scored (the pipeline drops them as
`env_lost`; a score that still arrives for one is ignored by the buffer). Not guaranteed: balance
by work (one group's programs may run longer than another's).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gapless.cluster.names import env_name


class EnvActors:
    def __init__(self, count: int, restarts: int):
        self.count = count
        self.evictable = count > 1  # one actor stays today's pipeline: its death or stall ends the run
        self.slots = count + (restarts if self.evictable else 0)
        self.names = [env_name(slot, count) for slot in range(self.slots)]
        self.live: dict[int, Any] = {}  # slot -> the ActorSpec of the actor in it
        self.ready: set[int] = set()  # live slots whose actor reported Ready
        self.started = 0  # slots used so far (a restart takes the next one)
        self.route_of: dict[int, int] = {}  # group index -> slot, until scored or lost
        self.load: Counter[int] = Counter()  # slot -> groups routed to it, not scored

    def start(self, spec: Any) -> int:
        """Record the actor of the next free slot; returns the slot."""
        slot = self.started
        self.live[slot], self.started = spec, slot + 1
        return slot

    def mark_ready(self, name: str) -> None:
        if name in self.names:
            self.ready.add(self.names.index(name))

    def has_spare(self) -> bool:
        return self.started < self.slots

    def route(self, index: int) -> int:
        """The slot that scores group `index`: among the ready actors (all live ones while none is,
        at the start) the one holding the fewest unscored groups, lowest slot first."""
        ready = [e for e in self.live if e in self.ready] or list(self.live)
        slot = min(ready, key=lambda e: (self.load[e], e))
        self.route_of[index] = slot
        self.load[slot] += 1
        return slot

    def scored(self, index: int) -> None:
        slot = self.route_of.pop(index, None)
        if slot is not None:
            self.load[slot] -= 1

    def lost(self, slot: int) -> list[int]:
        """The actor in `slot` is gone: forget it and return the groups routed to it."""
        self.live.pop(slot, None)
        self.ready.discard(slot)
        self.load.pop(slot, None)
        indices = sorted(i for i, e in self.route_of.items() if e == slot)
        for index in indices:
            del self.route_of[index]
        return indices
