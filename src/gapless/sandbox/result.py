"""Outcome of one sandboxed run: the status set, the result record and how it is classified.

`classify` is a pure function from what the host observed (`Observation`) to a `Status` and the
limit that was hit. Its main invariant: `INFRA_ERROR` is returned only when the program provably
never started (its start-up line on the status pipe is missing, or init reported a start-up
failure), or when the run's init vanished without a report and no limit explains it. For a judged
job (envs/code/environment.py), also when its judge or its candidate's process died of a SIGKILL that no
limit explains: neither can send one to itself or to the other (`_is_killed_from_outside`). The
status pipe is written only by code that runs before the program's first line (boot.py), so a
program cannot make its own failure look like an infrastructure fault, nor its crash look like
success.

Evidence, strongest first: the wall deadline (host clock), unless the run had already hit a
limit the clock only followed (an OOM kill, its output cap, its process limit: a busy machine
drains a flood or runs a fork bomb's forks slower than the deadline); the program's wait status reported by
init; the slot cgroup's counters (an OOM kill, a refused fork); which tmpfs resource ran out
(init's statvfs after the program exited); the capture caps; last, Python's final stderr line.

NOT guaranteed, and why (documented heuristics, each in favour of blaming the program):
- Without a cgroup there is no OOM counter, so a SIGKILL we did not send reads as MEMORY_LIMIT.
- A SIGKILL with the run's CPU time at RLIMIT_CPU reads as the CPU limit (its hard stop).
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


EXIT_CANDIDATE_GONE = 75  # a judge's exit when its candidate's process is gone (boot.py, envs/code/sandbox_scripts/judge.py)


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
    if not seen.has_started:
        return Status.INFRA_ERROR, None, None, None
    if seen.oom_kills:  # the kernel killed for memory: the cause, even if the clock ran out
        return Status.MEMORY_LIMIT, "memory", None, int(signal.SIGKILL)
    if seen.is_deadline_hit:  # a limit it hit before the clock ran out is the cause, not the clock
        if seen.is_truncated:  # an output flood: the deadline came while its flood was drained
            return Status.OUTPUT_LIMIT, "output", None, int(signal.SIGKILL)
        if seen.pids_max_hits or _PROCESS_LINE.search(seen.stderr.decode("utf-8", errors="replace")):
            return Status.PROCESS_LIMIT, "processes", None, int(signal.SIGKILL)  # a fork bomb still forking
        return Status.TIMEOUT, "wall", None, int(signal.SIGKILL)
    if seen.returncode is None:  # init died without reporting: only the kernel could do that
        return Status.INFRA_ERROR, None, None, None
    if seen.is_judged and _is_killed_from_outside(seen):
        return Status.INFRA_ERROR, None, None, int(signal.SIGKILL)
    if seen.is_judged and seen.returncode == EXIT_CANDIDATE_GONE and seen.candidate_returncode is not None:
        seen = replace(seen, returncode=seen.candidate_returncode)  # its end explains the run's
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


def _is_killed_from_outside(seen: Observation) -> bool:
    """A judged job's judge or candidate died of a SIGKILL that no limit explains. Neither can
    have sent it: the candidate is pid 1 of its own pid namespace and session (its own
    processes cannot kill it, and it cannot see the judge) and the judge runs trusted code; the
    host sends one only at the deadline. Needs the slot's cgroup: without its OOM counter, a
    SIGKILL reads as the memory limit (module docstring)."""
    if seen.oom_kills != 0:  # None (no cgroup) or a kill for memory
        return False
    for code, cpu_s in ((seen.returncode, seen.cpu_s), (seen.candidate_returncode, seen.candidate_cpu_s)):
        is_cpu_limit = cpu_s is not None and seen.cpu_limit_s and cpu_s >= seen.cpu_limit_s
        if code == -signal.SIGKILL and not is_cpu_limit:
            return True
    return False


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
