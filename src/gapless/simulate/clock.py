"""The simulated clock: a discrete-event loop over seconds that never touch the wall clock.

    loop = EventLoop()
    token = loop.after(0.5, callback)   # callback() runs when the clock reaches now + 0.5
    loop.cancel(token)                  # a rescheduled completion: the old event is skipped
    loop.run(until=lambda: done)        # pops events in time order until `until()` or no events

Guaranteed: events run in non-decreasing time order, and events scheduled for the same instant
run in the order they were scheduled (a sequence number breaks ties), so a simulation is a pure
function of its inputs and seed. `loop.now` is what the real modules get as their `clock`
(`PartialRollouts(clock=loop.clock)`). Not guaranteed: anything about wall time.
"""

from __future__ import annotations

import heapq
from typing import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._cancelled: set[int] = set()

    def clock(self) -> float:
        return self.now

    def at(self, time_s: float, callback: Callable[[], None]) -> int:
        if time_s < self.now:
            raise ValueError(f"event scheduled in the past ({time_s} < now {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, callback))
        return self._seq

    def after(self, delay_s: float, callback: Callable[[], None]) -> int:
        return self.at(self.now + max(delay_s, 0.0), callback)

    def cancel(self, token: int | None) -> None:
        if token is not None:
            self._cancelled.add(token)

    def run(self, until: Callable[[], bool], max_time_s: float = float("inf")) -> None:
        heap, cancelled = self._heap, self._cancelled
        while heap and not until():
            time_s, seq, callback = heapq.heappop(heap)
            if seq in cancelled:
                cancelled.discard(seq)
                continue
            if time_s > max_time_s:
                raise RuntimeError(
                    f"simulation passed {max_time_s:.0f} simulated seconds without finishing: "
                    "a stage never completes (check the cost model for zero rates)"
                )
            self.now = time_s
            callback()
