"""Fault points: named places where the crash tests kill or stop a pipeline process on purpose.

`GAPLESS_FAULT="ACTOR:POINT:N[:ACTION]"` makes process ACTOR (trainer | generator | environment,
or one generator replica by its process name, `generator-1`) deliver ACTION to itself the N-th
time it passes POINT, after printing a "gapless fault:" line to its stderr and, if
`GAPLESS_FAULT_LOG` names a file, appending it there. Actions: kill = SIGKILL (the default);
stop = SIGSTOP; hang = stay there for good, alive, calling the point's `alive` (its heartbeat)
every 0.05 s: a live process that makes no progress (a livelock; a point without `alive` is a
wedged call); raise = raise `InjectedFault` there (an error of the code at the point). The points:

    trainer      step        start of a training step, rollouts taken
                 publish     inside a weight publish: the new weights half copied, not yet flipped
                 checkpoint  inside a checkpoint write: model written, optimizer and rename pending
    generator    decode      after a decode step
                 fetch       inside a weight fetch, holding the buffer's lock
                 vllm_step   inside the vLLM engine's step, before vLLM's own (a real engine: its
                             step wedged or failing); in whichever process runs the engine, by role
    environment  score       a group scored, not yet sent to the trainer

Unset (every real run) a fault point costs one attribute test. tests/integration/test_faults.py
draws seeded cases from `POINTS` and checks the run's behaviour after each;
tests/integration/test_vllm_faults.py uses `vllm_step`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

POINTS = {
    "trainer": ("step", "publish", "checkpoint"),
    "generator": ("decode", "fetch"),
    "environment": ("score",),
}
ENGINE_POINTS = {"generator": ("vllm_step",)}  # only where that engine runs: not in the sweep's POINTS
_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hang": None, "raise": None}


class InjectedFault(RuntimeError):
    """What action 'raise' raises at its point."""


def _parse(spec: str | None) -> tuple[str, str, int, str] | None:
    if not spec:
        return None
    parts = spec.split(":")
    actor, point, count = parts[0], parts[1], int(parts[2])
    action = parts[3] if len(parts) > 3 else "kill"
    role = actor.split("-")[0]
    if point not in POINTS.get(role, ()) + ENGINE_POINTS.get(role, ()) or action not in _ACTIONS or count < 1:
        raise ValueError(
            f"GAPLESS_FAULT={spec!r}: want ACTOR:POINT:N[:kill|stop|hang|raise] with points {POINTS} {ENGINE_POINTS}"
        )
    return actor, point, count, action


_FAULT: tuple[str, str, int, str] | None = _parse(os.environ.get("GAPLESS_FAULT"))
_hits = 0
_process_name: str | None = None  # an actor process's own name ('generator-1'), set at its start


def name_process(name: str) -> None:
    global _process_name
    _process_name = name


def process_role() -> str:
    """This process's actor role ('generator' for 'generator-1'); 'trainer' outside the actors."""
    return (_process_name or "trainer").split("-")[0]


def fault_point(actor: str, point: str, alive: Callable[[], None] | None = None) -> None:
    """Deliver the configured fault if this is its actor (by role or by process name), point and
    N-th pass. `alive`: what keeps the process's heartbeat while it hangs (action 'hang')."""
    global _hits
    if _FAULT is None or _FAULT[1] != point or _FAULT[0] not in (actor, _process_name):
        return
    _hits += 1
    if _hits == _FAULT[2]:
        # the crash tests time the run's reaction from this line (CLOCK_MONOTONIC is machine-wide)
        signum = _ACTIONS[_FAULT[3]]
        line = f"gapless fault: {signum.name if signum else _FAULT[3]} {actor} at {point} #{_hits} t={time.monotonic():.3f}"
        print(line, file=sys.stderr, flush=True)
        if log := os.environ.get("GAPLESS_FAULT_LOG"):  # a Ray actor's stderr reaches the driver late, if at all
            with open(log, "a") as f:
                f.write(line + "\n")
        if signum is not None:
            os.kill(os.getpid(), signum)
            return  # a stopped process goes on once continued
        if _FAULT[3] == "raise":
            raise InjectedFault(line)
        while True:  # hang: beat, never return
            if alive is not None:
                alive()
            time.sleep(0.05)
