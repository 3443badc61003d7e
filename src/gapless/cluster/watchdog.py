"""Bounded waits: heartbeats and progress marks of the pipeline's processes, and the diagnosis of a stall.

A heartbeat says an actor's process is alive; a progress mark says it got work done. Each
actor's main loop stamps its heartbeat (a shared array of CLOCK_MONOTONIC times, which every
process on the machine reads alike) on every pass; its loops never block longer than a poll.
During set-up (model load, kernel build, sandbox start) a thread beats instead (`beating`).
Beside the heartbeat each actor publishes a progress counter, when it last moved and what moved
it (`Heartbeats.progress`): the generator per decode step (tokens decoded) and per weight load,
the environment per group scored and per tool call answered. A mark costs a counter bump and a
short text write in shared memory: no lock, no system call.

Who waits for whom while the trainer waits for step t's groups:

    trainer ──Assign (admission: the budget)──> generator ──groups / turns──> environment
       ^   (waits for step t's groups)         decode steps,                 groups scored,
       │                                       weights applied               tool calls answered
       └────────────────────────────── Scored <────────────────────────────────────┘
    generator ──(budget spent: nothing admitted)──> waits for the trainer's next step

The work the trainer waits for moves down that chain: while the generator decodes a long
rollout the environment has nothing to score; while the environment scores the last groups the
generator may have nothing to do, held by the budget until the trainer's next step. An actor
with nothing to do is waiting on another, not stalled. So the trainer's wait stalls when

    - an actor's heartbeat is older than stall_timeout_s, or its process is stopped (a dead,
      stopped or hung process: found without waiting for the others), or
    - no actor it waits on made progress for stall_timeout_s, counted from the start of the
      wait or the last group that arrived, whichever is later (the trainer's own work between
      two waits is not the actors' silence): a live pipeline that gets nothing done (an actor
      looping without progress, a lost message, two actors waiting on each other).

A wait for a group that is still being generated is never a stall, however long the group.
On a stall the trainer writes `RUN_DIR/stall.txt` (who waited for whom, since when, each
process's state from /proc, its heartbeat's age and what it last progressed on, when) and every
process's Python stack to `RUN_DIR/stacks/` (actors dump theirs on SIGUSR1 through faulthandler; a
stopped process is continued so that it can), then raises.

Guaranteed: a stopped, killed or silent actor ends the run within stall_timeout_s plus the poll
and the dump (a few seconds); a pipeline in which no actor progresses ends it within
stall_timeout_s of its last progress (or of the start of the wait) plus the same. Not
guaranteed: that an actor which hangs while others still progress is found before the others
run out of work (the wait stalls once none progresses); that the text of a mark read while it is
being written is whole (a best-effort retry; it is a diagnosis, not data); a stack from a process
stuck inside C code that never returns to the interpreter (faulthandler still prints the frame it
is in).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gapless.errors import InfrastructureError

ACTORS = ("trainer", "generator", "environment")
DUMP_WAIT_S = 3.0
STARTUP_S = 120.0  # spawn and imports of an actor, before it can beat (torch alone takes seconds)
WHAT_BYTES = 160  # room for what an actor last progressed on (longer texts are cut)


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


@dataclass(frozen=True)
class Progress:
    """An actor's progress as the trainer sees it: marks so far, seconds since the last (or since
    the actor was started, before its first), and what that mark was about."""

    marks: int
    age_s: float
    what: str


class Heartbeats:
    """Per actor, in shared memory and picklable to spawned actors: a monotonic heartbeat time and
    pid, and its progress (a mark count, when it last moved, what moved it). `actors`: every name
    that may beat during the run (restarted replicas included). Writers take no lock: each actor's
    slots have one writing process (the environment's scoring threads may race on a mark, which
    loses at most a count)."""

    def __init__(self, ctx, actors: tuple[str, ...] = ACTORS):
        now, n = time.monotonic(), len(actors)
        self.actors = tuple(actors)
        self._beats = ctx.Array("d", [now] * n, lock=False)
        self._pids = ctx.Array("q", [0] * n, lock=False)
        self._marks = ctx.Array("q", [0] * n, lock=False)
        self._progress_at = ctx.Array("d", [now] * n, lock=False)
        self._what = ctx.Array("c", WHAT_BYTES * n, lock=False)
        self._written: dict[
            int, str
        ] = {}  # the text this process last wrote per slot (unchanged text is not rewritten)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_written"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._written = {}

    def register(self, actor: str) -> None:
        self._pids[self.actors.index(actor)] = os.getpid()
        self.beat(actor)

    def beat(self, actor: str) -> None:
        self._beats[self.actors.index(actor)] = time.monotonic()

    def progress(self, actor: str, what: str) -> None:
        """`actor` got work done (`what`, in words: "decoded 8 tokens ..."): per decode step, group
        scored, tool call answered, weights applied; never per token."""
        i = self.actors.index(actor)
        if self._written.get(i) != what:  # one memmove (a slice assignment copies byte by byte)
            ctypes.memmove(
                ctypes.addressof(self._what) + i * WHAT_BYTES,
                what.encode()[:WHAT_BYTES].ljust(WHAT_BYTES, b"\0"),
                WHAT_BYTES,
            )
            self._written[i] = what
        self._marks[i] += 1
        self._progress_at[i] = time.monotonic()

    def starting(self, actor: str) -> None:
        """`actor` is being spawned now (a replacement replica): its start-up allowance starts now,
        and so does the time since its last progress."""
        i = self.actors.index(actor)
        self._pids[i] = 0
        self._progress_at[i] = time.monotonic()
        self.beat(actor)

    def beating(self, actor: str, every_s: float = 0.2):
        """Beat from a thread while the body runs (an actor's set-up: model load, kernel build,
        sandbox start): slow work is not a stall, but a stopped or killed process still is."""
        return beating(lambda: self.beat(actor), actor, every_s)

    def age_s(self, actor: str) -> float:
        return time.monotonic() - self._beats[self.actors.index(actor)]

    def pid(self, actor: str) -> int:
        return int(self._pids[self.actors.index(actor)])

    def progress_age_s(self, actor: str) -> float:
        return time.monotonic() - self._progress_at[self.actors.index(actor)]

    def last_progress(self, actor: str) -> Progress:
        i = self.actors.index(actor)
        for _ in range(3):  # read again if a mark landed meanwhile (its text may be half written)
            marks, at = int(self._marks[i]), self._progress_at[i]
            what = ctypes.string_at(ctypes.addressof(self._what) + i * WHAT_BYTES, WHAT_BYTES)
            what = what.rstrip(b"\0").decode(errors="replace")
            if int(self._marks[i]) == marks:
                break
        return Progress(marks, time.monotonic() - at, what)


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
    names = {
        "R": "running",
        "S": "sleeping",
        "D": "in uninterruptible I/O",
        "T": "stopped",
        "t": "stopped by a tracer",
        "Z": "zombie",
    }
    return f"{state} ({names.get(state, 'other')})"


class StallWatch:
    """The trainer's side: `check` raises PipelineStalled with the diagnosis when a wait is stuck
    (the rule is the module's docstring)."""

    def __init__(self, heartbeats: Heartbeats, timeout_s: float, run_dir: Path, actors: tuple[str, ...]):
        self.heartbeats, self.timeout_s, self.run_dir, self.actors = heartbeats, timeout_s, Path(run_dir), list(actors)
        self.progress_at = time.monotonic()
        self.startup_s = max(timeout_s, STARTUP_S)

    def progressed(self) -> None:
        """Something arrived, or the trainer starts a new wait (its own work is not a stall)."""
        self.progress_at = time.monotonic()

    def idle_s(self) -> float:
        """Seconds in which neither a waited-on actor progressed nor anything arrived, in this wait."""
        quiet = [self.heartbeats.progress_age_s(actor) for actor in self.actors]
        return min([time.monotonic() - self.progress_at, *quiet])

    def check(self, waiting_for: str, starting: bool = False) -> None:
        """`waiting_for`: what the trainer is waiting for, in words ("step 4's rollouts"). While
        `starting` (the actors' set-up: spawn, imports, engine, sandbox) every actor gets the
        start-up allowance: a set-up thread beats for it, but imports that hold the GIL can starve
        that thread for seconds on a loaded machine. A stopped actor process does not (on this
        host: its state is read from /proc)."""
        limit = self.startup_s if starting else self.timeout_s
        stale = [a for a in self.actors if self._silent(a, limit)]
        if stale or self.idle_s() > limit:
            self.stall(waiting_for, time.monotonic() - self.progress_at, stale)

    def _silent(self, actor: str, limit: float) -> bool:
        """Silent past `limit` (the start-up allowance before it has a pid); a process that is
        stopped (SIGSTOP, a tracer) gets no start-up allowance: it is not slow, it does nothing."""
        age, pid = self.heartbeats.age_s(actor), self.heartbeats.pid(actor)
        if not pid:
            return age > self.startup_s
        return age > limit or (age > self.timeout_s and process_state(pid).startswith(("T", "t")))

    def stall(self, waiting_for: str, waited: float, stale: list[str]) -> None:
        """Write the diagnosis and the stacks, then raise PipelineStalled. `stale`: the actors
        whose heartbeat stopped; none: no actor progressed."""
        if stale:
            why = f"waiting on {' and '.join(stale)}, whose heartbeat stopped"
        else:
            none = "which made no progress" if len(self.actors) == 1 else "none of which made progress"
            why = (
                f"waiting on {' and '.join(self.actors) or 'no actor'}, {none} for {self.idle_s():.1f} s "
                f"(pipeline.stall_timeout_s = {self.timeout_s:g} s)"
            )
        lines = [
            f"pipeline stalled: the trainer has waited {waited:.1f} s for {waiting_for} (since {_clock(waited)}); {why}"
        ]
        for actor in self.actors:
            pid, progress = self.heartbeats.pid(actor), self.heartbeats.last_progress(actor)
            lines.append(
                f"  {actor}: pid {pid}, last heartbeat {self.heartbeats.age_s(actor):.1f} s ago, "
                f"state {process_state(pid) if pid else 'not started'}; {_progress_line(progress)}"
            )
        lines.append(
            f"  stacks: {self.run_dir / 'stacks'}. Slow work that progresses is never a stall: raise "
            f"pipeline.stall_timeout_s ({self.timeout_s:g} s) only if one decode step, tool call or "
            "group's scoring legitimately takes longer"
        )
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


def _clock(ago_s: float) -> str:
    """The wall-clock time `ago_s` seconds ago, HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(time.time() - ago_s))


def _progress_line(progress: Progress) -> str:
    if not progress.marks:
        return f"no progress since it started {progress.age_s:.1f} s ago"
    return (
        f"progress mark {progress.marks}, the last {progress.age_s:.1f} s ago (at {_clock(progress.age_s)}): "
        f"{progress.what}"
    )
