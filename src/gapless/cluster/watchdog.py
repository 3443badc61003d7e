"""Bounded waits: heartbeats of the pipeline's processes and the diagnosis of a stall.

Each actor's main loop stamps its heartbeat (a shared array of CLOCK_MONOTONIC times, which every
process on the machine reads alike) on every pass; its loops never block longer than a poll.
During set-up (model load, kernel build, sandbox start) a thread beats instead (`beating`).
The trainer checks the heartbeats, and how long it has waited for progress, whenever it waits:

    trainer waits for rollouts ──> generator beat older than stall_timeout_s?  ─┐
                               ──> environment beat older than stall_timeout_s? ├─> PipelineStalled
                               ──> no group arrived for stall_timeout_s?        ─┘

On a stall the trainer writes `RUN_DIR/stall.txt` (who waited for whom, since when, each
process's state from /proc) and every process's Python stack to `RUN_DIR/stacks/` (actors dump
theirs on SIGUSR1 through faulthandler; a stopped process is continued so that it can), then
raises. Guaranteed: a stalled actor ends the run within stall_timeout_s plus the poll and the
dump (a few seconds). Not guaranteed: a stack from a process stuck inside C code that never
returns to the interpreter (faulthandler still prints the frame it is in).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path

from gapless.errors import InfrastructureError

ACTORS = ("trainer", "generator", "environment")
DUMP_WAIT_S = 3.0
STARTUP_S = 120.0  # spawn and imports of an actor, before it can beat (torch alone takes seconds)


class PipelineStalled(InfrastructureError):
    """An actor stopped making progress for longer than pipeline.stall_timeout_s."""


class StopFlag:
    """The run's stop request, readable by every actor without a lock: a process killed while
    reading it cannot block the others (a multiprocessing.Event's lock would stay taken)."""

    def __init__(self, ctx):
        self._flag = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.is_set() and time.monotonic() < deadline:
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
        return self.is_set()


class Heartbeats:
    """One monotonic timestamp and pid per actor, in shared memory; picklable to spawned actors.
    `actors`: every name that may beat during the run (restarted replicas included), lock-free."""

    def __init__(self, ctx, actors: tuple[str, ...] = ACTORS):
        now = time.monotonic()
        self.actors = tuple(actors)
        self._beats = ctx.Array("d", [now] * len(self.actors), lock=False)
        self._pids = ctx.Array("q", [0] * len(self.actors), lock=False)

    def register(self, actor: str) -> None:
        self._pids[self.actors.index(actor)] = os.getpid()
        self.beat(actor)

    def beat(self, actor: str) -> None:
        self._beats[self.actors.index(actor)] = time.monotonic()

    def starting(self, actor: str) -> None:
        """`actor` is being spawned now (a replacement replica): its start-up allowance starts now."""
        self._pids[self.actors.index(actor)] = 0
        self.beat(actor)

    def beating(self, actor: str, every_s: float = 0.2):
        """Beat from a thread while the body runs (an actor's set-up: model load, kernel build,
        sandbox start): slow work is not a stall, but a stopped or killed process still is."""
        return beating(lambda: self.beat(actor), actor, every_s)

    def age_s(self, actor: str) -> float:
        return time.monotonic() - self._beats[self.actors.index(actor)]

    def pid(self, actor: str) -> int:
        return int(self._pids[self.actors.index(actor)])


@contextlib.contextmanager
def beating(beat, actor: str, every_s: float = 0.2):
    """Call `beat()` from a thread every `every_s` while the body runs, and once at its end (the
    heartbeats of every placement use it for an actor's set-up)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            beat()

    thread = threading.Thread(target=loop, name=f"{actor}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        beat()


def install_stack_dump(run_dir: Path, actor: str) -> None:
    """Make SIGUSR1 write this process's Python stacks to RUN_DIR/stacks/ACTOR-PID.txt."""
    stacks = Path(run_dir) / "stacks"
    stacks.mkdir(parents=True, exist_ok=True)
    fh = open(stacks / f"{actor}-{os.getpid()}.txt", "w")  # kept open for the process's life
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)


def process_state(pid: int) -> str:
    """'R (running)', 'S (sleeping)', 'T (stopped)', ... from /proc, or 'gone'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = stat.rsplit(")", 1)[1].split()[0]
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped by a tracer",
             "Z": "zombie"}
    return f"{state} ({names.get(state, 'other')})"


class StallWatch:
    """The trainer's side: `check` raises PipelineStalled with the diagnosis when a wait is stuck."""

    def __init__(self, heartbeats: Heartbeats, timeout_s: float, run_dir: Path, actors: tuple[str, ...]):
        self.heartbeats, self.timeout_s, self.run_dir, self.actors = heartbeats, timeout_s, Path(run_dir), list(actors)
        self.progress_at = time.monotonic()
        self.startup_s = max(timeout_s, STARTUP_S)

    def progressed(self) -> None:
        """Something arrived, or the trainer starts a new wait (its own work is not a stall)."""
        self.progress_at = time.monotonic()

    def check(self, waiting_for: str, starting: bool = False) -> None:
        """`waiting_for`: what the trainer is waiting for, in words ("step 4's rollouts"). While
        `starting` (the actors' set-up: spawn, imports, engine, sandbox) every actor gets the
        start-up allowance: a set-up thread beats for it, but imports that hold the GIL can starve
        that thread for seconds on a loaded machine. A stopped actor process does not (on this
        host: its state is read from /proc)."""
        limit = self.startup_s if starting else self.timeout_s
        stale = [a for a in self.actors if self._silent(a, limit)]
        waited = time.monotonic() - self.progress_at
        if stale or waited > limit:
            self.stall(waiting_for, waited, stale)

    def _silent(self, actor: str, limit: float) -> bool:
        """Silent past `limit` (the start-up allowance before it has a pid); a process that is
        stopped (SIGSTOP, a tracer) gets no start-up allowance: it is not slow, it does nothing."""
        age, pid = self.heartbeats.age_s(actor), self.heartbeats.pid(actor)
        if not pid:
            return age > self.startup_s
        return age > limit or (age > self.timeout_s and process_state(pid).startswith(("T", "t")))

    def stall(self, waiting_for: str, waited: float, stale: list[str]) -> None:
        """Write the diagnosis and the stacks, then raise PipelineStalled."""
        who = " and ".join(stale) if stale else "the generator and the environment"
        lines = [f"pipeline stalled: the trainer has waited {waited:.1f} s for {waiting_for} "
                 f"(since {time.strftime('%H:%M:%S', time.localtime(time.time() - waited))}); waiting on {who}"]
        for actor in self.actors:
            pid = self.heartbeats.pid(actor)
            lines.append(f"  {actor}: pid {pid}, last heartbeat {self.heartbeats.age_s(actor):.1f} s ago, "
                         f"state {process_state(pid) if pid else 'not started'}")
        lines.append(f"  stacks: {self.run_dir / 'stacks'}; raise pipeline.stall_timeout_s "
                     f"({self.timeout_s:g} s) if this work is legitimately slow")
        diagnosis = "\n".join(lines)
        self._dump_stacks()
        (self.run_dir / "stall.txt").write_text(diagnosis + "\n")
        raise PipelineStalled(diagnosis)

    def _dump_stacks(self) -> None:
        stacks = self.run_dir / "stacks"
        stacks.mkdir(parents=True, exist_ok=True)
        with open(stacks / f"trainer-{os.getpid()}.txt", "w") as fh:
            faulthandler.dump_traceback(file=fh, all_threads=True)
        files = []
        for actor in self.actors:
            pid = self.heartbeats.pid(actor)
            if not pid or process_state(pid) == "gone":
                continue
            path = stacks / f"{actor}-{pid}.txt"
            try:
                os.kill(pid, signal.SIGUSR1)
                if process_state(pid).startswith("T"):
                    os.kill(pid, signal.SIGCONT)  # a stopped process handles the dump once continued
            except ProcessLookupError:
                continue
            files.append(path)
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline and not all(p.is_file() and p.stat().st_size for p in files):
            time.sleep(0.05)
