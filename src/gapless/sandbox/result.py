"""Outcome of one sandboxed run: the status set, the result record and how it is classified.

`classify` is a pure function from what the host observed (`Observation`) to a `Status` and the
limit that was hit. Its main invariant, the attribution rule (docs/sandbox.md has the table):
`INFRA_ERROR` rests only on evidence the program cannot produce. Here that is: the program's
start-up line is missing from the status pipe (written by trusted start-up code before the
program's first line, boot.py; a judged job's candidate runs none of its own code before the
judge's start-up line is written, envs/code/sandbox_scripts/candidate.py), or init reported a start-up failure
before that line, or a judged job's judge (trusted code) says its candidate's process died in
its trusted start-up (`EXIT_CANDIDATE_NOT_STARTED`, envs/code/sandbox_scripts/judge.py). The pool adds the
failures it observes itself: no slot, no server, a job it could not send (pool.py). Nothing the
program can produce after its first line (its exit status, its signals, its own or init's
limits, its output, init dying of what it did) yields `INFRA_ERROR`.

A death that neither a limit nor the host explains is `KILLED`, a status of the program's own:
init vanishing without its final report after the program started (the program can lower init's
limits, or starve it of memory), or a judged job's judge or candidate dying of a SIGKILL that no
limit explains (the candidate can lower its own hard RLIMIT_CPU and be killed by the kernel). A
host-wide cause (the kernel's global OOM killer, an operator) looks the same from here, so the
pool runs a `KILLED` job once more on a fresh slot and keeps that second result: an outage that
does not recur is scored by the run that was not hit, one that recurs is the program's doing.

Evidence, strongest first: the wall deadline (host clock), unless the run had already hit a
limit the clock only followed (an OOM kill, its output cap, its process limit: a busy machine
drains a flood or runs a fork bomb's forks slower than the deadline); the program's wait status reported by
init; the slot cgroup's counters (an OOM kill, a refused fork); which tmpfs resource ran out
(init's statvfs after the program exited); the capture caps; last, Python's final stderr line.

NOT guaranteed, and why (documented heuristics, each in favour of blaming the program):
- Without a cgroup there is no OOM counter, so a SIGKILL we did not send reads as MEMORY_LIMIT.
- A SIGKILL with the run's CPU time at RLIMIT_CPU reads as the CPU limit (its hard stop).
- A plain (not judged) program's unexplained SIGKILL is NONZERO_EXIT: it can signal itself.
- An outage that hits the same job on two slots in a row is scored as the program's `KILLED`.
- The stderr heuristics read the last line (e.g. `BlockingIOError: [Errno 11] ...` from a
  refused fork); a program that prints such a line itself gets that status.
- HARNESS_INCOMPLETE is the caller's verdict (e.g. envs/code/environment.py): the sandbox cannot know how
  many results a harness owes.
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass, replace
from enum import Enum

from gapless.errors import InfrastructureError

EXIT_CANDIDATE_GONE = (
    75  # a judge's exit when its candidate's process is gone (boot.py, envs/code/sandbox_scripts/judge.py)
)
EXIT_CANDIDATE_NOT_STARTED = (
    76  # a judge's exit when its candidate died in trusted start-up (envs/code/sandbox_scripts/judge.py)
)


class Status(str, Enum):
    """What happened to a run. Every status except INFRA_ERROR is the program's doing."""

    OK = "ok"  # exited 0
    NONZERO_EXIT = "nonzero_exit"  # exited nonzero (e.g. uncaught exception) or died by a signal
    COMPILE_ERROR = "compile_error"  # main does not compile (SyntaxError before it ran)
    TIMEOUT = "timeout"  # wall deadline (limit "wall") or RLIMIT_CPU / SIGXCPU (limit "cpu")
    MEMORY_LIMIT = "memory_limit"  # MemoryError (RLIMIT_AS) or killed by the memory cgroup
    PROCESS_LIMIT = "process_limit"  # fork or thread creation refused (pids cgroup, NPROC)
    DISK_LIMIT = "disk_limit"  # EFBIG (RLIMIT_FSIZE), tmpfs bytes full, or SIGXFSZ
    INODE_LIMIT = "inode_limit"  # tmpfs out of inodes (too many files)
    OUTPUT_LIMIT = "output_limit"  # stdout, stderr or the report exceeded its cap (truncated)
    HARNESS_INCOMPLETE = "harness_incomplete"  # the program exited before reporting every test
    KILLED = "killed"  # died in a way no limit and no act of the host explains, on a fresh slot too
    INFRA_ERROR = "infra_error"  # the sandbox failed; retried once on another slot, never scored


class SandboxError(InfrastructureError):
    """The sandbox cannot work on this machine; the message says what to do about it."""


@dataclass
class SandboxResult:
    """Record of one run. Text fields are decoded with errors="replace" after truncation."""

    status: Status
    exit_code: int | None  # None when the program died by a signal (ours or another)
    signal: int | None  # the signal that ended it, if any (SIGKILL when we hit the deadline)
    stdout: str
    stderr: str  # for INFRA_ERROR: the sandbox's own message
    wall_s: float  # from sending the job (cold path: from spawning bwrap) to its end
    truncated: bool  # stdout, stderr or report exceeded its cap
    limit: str | None  # limit hit: wall, cpu, memory, processes, disk, inodes, output
    report: bytes  # what the program wrote to fd 3, capped; untrusted data
    cpu_s: float | None = None  # CPU time of every process of the run (None: unknown)
    queue_s: float = 0.0  # time spent waiting for admission and a slot
    slot: int | None = None  # slot index that ran it (the last one, after a retry)
    attempts: int = 1  # 2 when an infrastructure failure was retried on another slot
    path: str = "cold"  # warm (forked from a pre-started server), cold, or reduced

    def to_json(self) -> dict[str, object]:
        """JSON-serialisable dict; the report is text with undecodable bytes as \\xNN escapes."""
        record = asdict(self)
        record["status"] = self.status.value
        record["report"] = self.report.decode("utf-8", errors="backslashreplace")
        return record


@dataclass(frozen=True)
class Observation:
    """What the host saw of a run, before interpretation."""

    has_started: bool  # the program's start-up line said started (its code was reached)
    returncode: int | None  # the program's exit code, -N for signal N; None: no final report
    is_deadline_hit: bool
    stderr: bytes
    is_truncated: bool
    compile_error: str | None = None  # main did not compile (start-up line)
    full_filesystem: str | None = None  # "inodes" or "bytes": what /tmp lacked at the end
    oom_kills: int | None = None  # cgroup OOM kills during the run; None: no cgroup
    pids_max_hits: int | None = None  # forks refused by pids.max during the run
    cpu_s: float | None = None
    cpu_limit_s: int | None = None  # RLIMIT_CPU soft limit of the run
    is_judged: bool = False  # a judged job: the program is the judge, which runs trusted code
    candidate_returncode: int | None = None  # a judged job's candidate process, if it ended
    candidate_cpu_s: float | None = None


_MEMORY_LINE = re.compile(r"^MemoryError\b|\[Errno 12\]")
_PROCESS_LINE = re.compile(r"\[Errno 11\] Resource temporarily unavailable|can't start new thread")
_DISK_LINE = re.compile(r"\[Errno 2[78]\]")

Verdict = tuple[Status, "str | None", "int | None", "int | None"]  # status, limit, exit, signal


def classify(seen: Observation) -> Verdict:
    """(status, limit, exit_code, signal) for one run; precedence follows the code below."""
    if seen.compile_error is not None:
        return Status.COMPILE_ERROR, None, 1, None
    if not seen.has_started:  # no untrusted code has run: the sandbox's own failure
        return Status.INFRA_ERROR, None, None, None
    if seen.oom_kills:  # the kernel killed for memory: the cause, even if the clock ran out
        return Status.MEMORY_LIMIT, "memory", None, int(signal.SIGKILL)
    if seen.is_deadline_hit:  # a limit it hit before the clock ran out is the cause, not the clock
        if seen.is_truncated:  # an output flood: the deadline came while its flood was drained
            return Status.OUTPUT_LIMIT, "output", None, int(signal.SIGKILL)
        if seen.pids_max_hits or _PROCESS_LINE.search(seen.stderr.decode("utf-8", errors="replace")):
            return Status.PROCESS_LIMIT, "processes", None, int(signal.SIGKILL)  # a fork bomb still forking
        return Status.TIMEOUT, "wall", None, int(signal.SIGKILL)
    if seen.returncode is None:  # init died after the program started: it shares init's limits and memory
        return Status.KILLED, None, None, None
    if seen.is_judged:
        if seen.returncode == EXIT_CANDIDATE_NOT_STARTED:  # the judge's word: trusted start-up failed
            return Status.INFRA_ERROR, None, None, None
        if seen.returncode == EXIT_CANDIDATE_GONE and seen.candidate_returncode is not None:
            seen = replace(
                seen, returncode=seen.candidate_returncode, cpu_s=seen.candidate_cpu_s
            )  # its end is the run's
        if _is_unexplained_kill(seen):
            return Status.KILLED, None, None, int(signal.SIGKILL)
    exit_code, signum = (None, -seen.returncode) if seen.returncode < 0 else (seen.returncode, None)
    if signum is not None:
        status, limit = _status_from_signal(signum, seen)
        return status, limit, None, signum
    if seen.is_truncated:
        return Status.OUTPUT_LIMIT, "output", exit_code, None
    if exit_code == 0:
        return Status.OK, None, 0, None
    status, limit = _status_from_evidence(seen)
    return status, limit, exit_code, None


def _is_unexplained_kill(seen: Observation) -> bool:
    """A judged job ended by a SIGKILL (of the judge, or of the candidate whose end ended the
    judge) that neither the memory cgroup nor the CPU limit explains. The candidate can bring
    one on itself (a lowered hard RLIMIT_CPU), so this is `KILLED`, never INFRA_ERROR; the
    pool's second run on a fresh slot tells a host-wide kill from the candidate's own. Needs
    the slot's cgroup: without its OOM counter, a SIGKILL reads as the memory limit."""
    if seen.oom_kills != 0 or seen.returncode != -signal.SIGKILL:  # None: no cgroup
        return False
    return not (seen.cpu_s is not None and seen.cpu_limit_s and seen.cpu_s >= seen.cpu_limit_s)


def _status_from_signal(signum: int, seen: Observation) -> tuple[Status, str | None]:
    if signum == signal.SIGXCPU:
        return Status.TIMEOUT, "cpu"
    if signum == signal.SIGXFSZ:
        return Status.DISK_LIMIT, "disk"
    if signum == signal.SIGKILL:
        if seen.oom_kills or seen.oom_kills is None:  # None: no cgroup, see module docstring
            return Status.MEMORY_LIMIT, "memory"
        if seen.cpu_s is not None and seen.cpu_limit_s and seen.cpu_s >= seen.cpu_limit_s:
            return Status.TIMEOUT, "cpu"
    if seen.is_truncated:
        return Status.OUTPUT_LIMIT, "output"
    return Status.NONZERO_EXIT, None


def _status_from_evidence(seen: Observation) -> tuple[Status, str | None]:
    if seen.full_filesystem == "inodes":
        return Status.INODE_LIMIT, "inodes"
    if seen.full_filesystem == "bytes":
        return Status.DISK_LIMIT, "disk"
    if seen.oom_kills:
        return Status.MEMORY_LIMIT, "memory"
    if seen.pids_max_hits:
        return Status.PROCESS_LIMIT, "processes"
    lines = seen.stderr.decode("utf-8", errors="replace").strip().splitlines()
    last_line = lines[-1] if lines else ""
    if _MEMORY_LINE.search(last_line):
        return Status.MEMORY_LIMIT, "memory"
    if _PROCESS_LINE.search(last_line):
        return Status.PROCESS_LIMIT, "processes"
    if _DISK_LINE.search(last_line):
        return Status.DISK_LIMIT, "disk"
    return Status.NONZERO_EXIT, None
