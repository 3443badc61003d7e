"""The shared pool: actors on the same cores (or devices) slow each other down.

With `placement = "shared"` every busy actor is a *job* holding some threads (its cap). When the
jobs' threads fit the pool each job gets its cap; otherwise the pool is shared in proportion to
threads, as a fair OS scheduler shares cores among runnable threads:

    allocation(job) = cap(job) * min(1, units / sum of caps of busy jobs)
    speed(job)      = min(x, 1) + parallel_efficiency * max(x - 1, 0)     for allocation x

With `barrier_teams`, a *team* job (an OpenMP team: the generator's decode, the trainer's step)
of more than one thread gains nothing from its threads while the pool is oversubscribed: it runs
at one thread's share, `speed = units / sum of caps` (< 1), while it still takes its cap from the
others. Its threads meet at a barrier after every parallel region, a thread preempted by another
job's makes the rest spin there, and the team goes no faster than its slowest thread
(the measurements: docs/lab/).

Two losses of an oversubscribed pool (1.0 = none, as in the built-in costs and in what `gapless
simulate --calibrate` fits; bench/simulator.py's joint fit fits them): a team held at one
thread's share keeps only `barrier_efficiency` of it (its spinning threads burn the time they wait),
and every job keeps `contention_efficiency` of its speed while the busy jobs' threads outnumber the
units (context switches, caches): an oversubscribed machine spends more CPU-seconds on the same
work.

With `decode_first`, a generator replica's decode on one thread or less (`first`) is served before
everything else: it runs at its cap's speed, and the other jobs share what is left by the rules
above, as long as the decodes served first leave at least one whole unit (else nobody is served
first). On some machines the OS scheduler serves a one-thread decode at about its speed alone
beside the sandbox's programs and the trainer, where sharing by thread count would leave it a
third of a core; on others it shares by threads. The rule is the machine's: calibration
(calibrate.py) keeps it or not by fit (`bench/simulator.py --part phases` and
`bench/contention.py` measure it; the figures are in docs/lab/). Not modelled: beside the sandbox
and a training thread at once the real decode can be slower than this rule says.

A job is told its speed through its `on_speed(speed)` callback whenever the set of busy jobs (or
a cap) changes, and must reschedule its own completion then. With `placement = "split"` there is
no pool: `DedicatedPool` gives every job speed 1 and never calls back.
Not guaranteed: anything between the two regimes (a team's loss does not grow with how far the
pool is oversubscribed), caches and memory bandwidth shared by the jobs. A two-thread team beside
the sandbox slowed 11.6x in bench/contention.py where this model says 5.7x (docs/simulator.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from gapless.simulate.costs import Costs


class SharedPool:
    def __init__(
        self,
        units: float,
        parallel_efficiency: float = 1.0,
        barrier_teams: bool = False,
        decode_first: bool = False,
        barrier_efficiency: float = 1.0,
        contention_efficiency: float = 1.0,
    ):
        self.units, self.efficiency, self.barrier_teams = units, parallel_efficiency, barrier_teams
        self.decode_first, self.barrier_efficiency = decode_first, barrier_efficiency
        self.contention_efficiency = contention_efficiency
        # key -> (cap, on_speed, team, first)
        self.jobs: dict[object, tuple[float, Callable[[float], None], bool, bool]] = {}
        self.speeds: dict[object, float] = {}

    @classmethod
    def for_costs(cls, units: float, costs: "Costs") -> "SharedPool":
        """The pool a cost model's sharing rules describe (its efficiencies, teams, decode first)."""
        return cls(
            units,
            costs.parallel_efficiency,
            costs.barrier_teams,
            costs.decode_first,
            costs.barrier_efficiency,
            costs.contention_efficiency,
        )

    def speed_of(self, allocation: float) -> float:
        return min(allocation, 1.0) + self.efficiency * max(allocation - 1.0, 0.0)

    def start(
        self, key: object, cap: float, on_speed: Callable[[float], None], team: bool = False, first: bool = False
    ) -> None:
        """`first`: a one-thread decode, served before the others when the pool has `decode_first`."""
        self.jobs[key] = (cap, on_speed, team, first and cap <= 1.0)
        self._share()

    def set_cap(self, key: object, cap: float) -> None:
        if key in self.jobs and self.jobs[key][0] != cap:
            self.jobs[key] = (cap, *self.jobs[key][1:])
            self._share()

    def stop(self, key: object) -> None:
        if self.jobs.pop(key, None) is not None:
            self.speeds.pop(key, None)
            self._share()

    def _share(self) -> None:
        first = {key: cap for key, (cap, _, _, is_first) in self.jobs.items() if is_first} if self.decode_first else {}
        if sum(first.values()) > self.units - 1.0:
            first = {}  # they would leave the others less than a unit: everyone shares
        left = self.units - sum(first.values())
        demand = sum(cap for key, (cap, *_) in self.jobs.items() if key not in first)
        scale = min(1.0, left / demand) if demand > 0 else 1.0
        for key, (cap, on_speed, team, _) in list(self.jobs.items()):
            if key in first:
                speed = self.speed_of(cap)
            elif team and self.barrier_teams and scale < 1.0 and cap > 1.0:
                speed = (
                    scale * self.barrier_efficiency
                )  # one thread's share at best: the others wait for it at the barrier
            else:
                speed = self.speed_of(cap * scale)
            if scale < 1.0:
                speed *= self.contention_efficiency  # more runnable threads than cores: switches, caches
            if self.speeds.get(key) != speed:
                self.speeds[key] = speed
                on_speed(speed)


class DedicatedPool:
    """Every actor on its own devices: speed 1, no contention."""

    def start(
        self, key: object, cap: float, on_speed: Callable[[float], None], team: bool = False, first: bool = False
    ) -> None:
        on_speed(1.0)

    def set_cap(self, key: object, cap: float) -> None:
        pass

    def stop(self, key: object) -> None:
        pass


class Work:
    """A fixed amount of work (seconds at speed 1) on a pool; calls `on_done()` when finished,
    tracking every speed change on the way. `team`: an OpenMP team (SharedPool.barrier_teams);
    `first`: a one-thread decode (SharedPool.decode_first)."""

    def __init__(
        self,
        loop,
        pool,
        cap: float,
        amount_s: float,
        on_done: Callable[[], None],
        team: bool = False,
        first: bool = False,
    ):
        self.loop, self.pool, self.on_done = loop, pool, on_done
        self.remaining, self.speed, self.t_last, self.token = amount_s, 0.0, loop.now, None
        self.finished = False
        pool.start(self, cap, self._on_speed, team, first)

    def _on_speed(self, speed: float) -> None:
        now = self.loop.now
        self.remaining -= (now - self.t_last) * self.speed
        self.t_last, self.speed = now, speed
        self.loop.cancel(self.token)
        self.token = self.loop.after(max(self.remaining, 0.0) / speed, self._done) if speed > 0 else None

    def set_cap(self, cap: float) -> None:
        self.pool.set_cap(self, cap)

    def _done(self) -> None:
        self.finished = True
        self.pool.stop(self)
        self.on_done()
