"""Outcome of one sandboxed run: the status set, the result record and how it is classified.

`classify` is a pure function from what the host observed (`Observation`) to a `Status` and the
limit that was hit. Its main invariant: `INFRA_ERROR` is returned only when the program provably
never started (the bootstrap's start marker is missing), so a program cannot make its own
failure look like an infrastructure fault by printing "bwrap: ..." and exiting 1.

NOT guaranteed, and why (all documented heuristics, each in favour of blaming the program):
- bwrap reports a signal death as exit code 128 + signal, so `sys.exit(152)` reads as SIGXCPU.
- A SIGKILL we did not send is reported as `MEMORY_LIMIT`: without a cgroup its sources are the
  kernel OOM killer and the RLIMIT_CPU hard limit (only reached by a program ignoring SIGXCPU).
- `MEMORY_LIMIT`, `PROCESS_LIMIT` and `DISK_LIMIT` on a nonzero exit are read from the last line
  of stderr (Python's uncaught-exception line), e.g. `BlockingIOError: [Errno 11] ...` from a
  refused fork; a program that prints such a line itself gets that status.
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass
from enum import Enum


class Status(str, Enum):
    """What happened to a run. Every status except INFRA_ERROR is the program's doing."""

    OK = "ok"  # exited 0
    NONZERO_EXIT = "nonzero_exit"  # exited nonzero (e.g. uncaught exception) or died by a signal
    TIMEOUT = "timeout"  # wall deadline (limit "wall") or RLIMIT_CPU / SIGXCPU (limit "cpu")
    MEMORY_LIMIT = "memory_limit"  # MemoryError / ENOMEM as the final error, or killed by SIGKILL
    PROCESS_LIMIT = "process_limit"  # fork or thread creation refused (RLIMIT_NPROC)
    DISK_LIMIT = "disk_limit"  # EFBIG (RLIMIT_FSIZE), ENOSPC (tmpfs full) or SIGXFSZ
    OUTPUT_LIMIT = "output_limit"  # stdout, stderr or the report exceeded its cap (truncated)
    INFRA_ERROR = "infra_error"  # the sandbox failed before the program started


class SandboxError(RuntimeError):
    """The sandbox cannot work on this machine; the message says what to do about it."""


@dataclass
class SandboxResult:
    """Record of one run. Text fields are decoded with errors="replace" after truncation."""

    status: Status
    exit_code: int | None  # None when the program died by a signal (ours or another)
    signal: int | None  # the signal that ended it, if any (SIGKILL when we hit the deadline)
    stdout: str
    stderr: str  # for INFRA_ERROR: the sandbox's own message
    wall_s: float  # from spawning bwrap to reaping it
    truncated: bool  # stdout, stderr or report exceeded its cap
    limit: str | None  # which limit was hit: wall, cpu, memory, processes, disk, output
    report: bytes  # what the program wrote to fd 3, capped; untrusted data

    def to_json(self) -> dict[str, object]:
        """JSON-serialisable dict; the report is text with undecodable bytes as \\xNN escapes."""
        record = asdict(self)
        record["status"] = self.status.value
        record["report"] = self.report.decode("utf-8", errors="backslashreplace")
        return record


@dataclass(frozen=True)
class Observation:
    """What the host saw of a run, before interpretation."""

    has_started: bool  # the bootstrap wrote its start marker, so the program's code was reached
    returncode: int | None  # bwrap's exit code; None if we killed it at the deadline
    is_deadline_hit: bool
    stderr: bytes
    is_truncated: bool


_MEMORY_LINE = re.compile(r"^MemoryError\b|\[Errno 12\]")
_PROCESS_LINE = re.compile(r"\[Errno 11\] Resource temporarily unavailable|can't start new thread")
_DISK_LINE = re.compile(r"\[Errno 2[78]\]")
_SIGNAL_STATUS = {
    signal.SIGXCPU: (Status.TIMEOUT, "cpu"),
    signal.SIGKILL: (Status.MEMORY_LIMIT, "memory"),
    signal.SIGXFSZ: (Status.DISK_LIMIT, "disk"),
}


def classify(seen: Observation) -> tuple[Status, str | None, int | None, int | None]:
    """(status, limit, exit_code, signal) for one run; precedence follows the list below."""
    if not seen.has_started:
        return Status.INFRA_ERROR, None, seen.returncode, None
    if seen.is_deadline_hit or seen.returncode is None:
        return Status.TIMEOUT, "wall", None, int(signal.SIGKILL)
    exit_code, signum = _split_returncode(seen.returncode)
    if signum is not None and signum in _SIGNAL_STATUS:
        status, limit = _SIGNAL_STATUS[signum]
        return status, limit, None, signum
    if seen.is_truncated:
        return Status.OUTPUT_LIMIT, "output", exit_code, signum
    if exit_code == 0:
        return Status.OK, None, 0, None
    status, limit = _status_from_stderr(seen.stderr) if signum is None else (None, None)
    return status or Status.NONZERO_EXIT, limit, exit_code, signum


def _split_returncode(returncode: int) -> tuple[int | None, int | None]:
    """bwrap exits with 128 + N when the program died by signal N (see module docstring)."""
    if 128 < returncode < 128 + signal.NSIG:
        return None, returncode - 128
    if returncode < 0:  # bwrap itself died by a signal we did not send
        return None, -returncode
    return returncode, None


def _status_from_stderr(stderr: bytes) -> tuple[Status | None, str | None]:
    lines = stderr.decode("utf-8", errors="replace").strip().splitlines()
    last_line = lines[-1] if lines else ""
    if _MEMORY_LINE.search(last_line):
        return Status.MEMORY_LIMIT, "memory"
    if _PROCESS_LINE.search(last_line):
        return Status.PROCESS_LIMIT, "processes"
    if _DISK_LINE.search(last_line):
        return Status.DISK_LIMIT, "disk"
    return None, None
