"""Pure tests of how a run's observation becomes a status (no bwrap needed)."""

from __future__ import annotations

import signal

import pytest

from gapless.sandbox.result import EXIT_CANDIDATE_GONE, EXIT_CANDIDATE_NOT_STARTED, Observation, Status, classify
from gapless.sandbox.streams import CappedSink


def observe(returncode: int | None, stderr: str = "", **overrides: object) -> Observation:
    fields = dict(has_started=True, returncode=returncode, is_deadline_hit=False,
                  stderr=stderr.encode(), is_truncated=False, oom_kills=0, pids_max_hits=0,
                  cpu_s=0.1, cpu_limit_s=6)  # fmt: skip
    fields.update(overrides)
    return Observation(**fields)  # type: ignore[arg-type]


KILLED = -signal.SIGKILL


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        (observe(0), (Status.OK, None, 0, None)),
        (observe(3, "ValueError: x"), (Status.NONZERO_EXIT, None, 3, None)),
        (observe(None, is_deadline_hit=True), (Status.TIMEOUT, "wall", None, signal.SIGKILL)),
        # at the deadline, a limit already hit is the cause (a busy machine drains a flood, or
        # runs a fork bomb's forks, slower than the clock)
        (observe(None, is_deadline_hit=True, is_truncated=True), (Status.OUTPUT_LIMIT, "output", None, signal.SIGKILL)),
        (
            observe(None, is_deadline_hit=True, pids_max_hits=4),
            (Status.PROCESS_LIMIT, "processes", None, signal.SIGKILL),
        ),
        (
            observe(None, "OSError: [Errno 11] Resource temporarily unavailable", is_deadline_hit=True),
            (Status.PROCESS_LIMIT, "processes", None, signal.SIGKILL),
        ),
        (observe(-signal.SIGXCPU), (Status.TIMEOUT, "cpu", None, signal.SIGXCPU)),
        (observe(-signal.SIGXFSZ), (Status.DISK_LIMIT, "disk", None, signal.SIGXFSZ)),
        (observe(KILLED, oom_kills=1), (Status.MEMORY_LIMIT, "memory", None, signal.SIGKILL)),
        (observe(KILLED, cpu_s=7.0), (Status.TIMEOUT, "cpu", None, signal.SIGKILL)),
        (observe(KILLED), (Status.NONZERO_EXIT, None, None, signal.SIGKILL)),  # it killed itself
        (observe(KILLED, oom_kills=None), (Status.MEMORY_LIMIT, "memory", None, signal.SIGKILL)),
        (observe(-signal.SIGSEGV), (Status.NONZERO_EXIT, None, None, signal.SIGSEGV)),
        (observe(1, full_filesystem="inodes"), (Status.INODE_LIMIT, "inodes", 1, None)),
        (observe(1, full_filesystem="bytes"), (Status.DISK_LIMIT, "disk", 1, None)),
        (observe(0, full_filesystem="inodes"), (Status.OK, None, 0, None)),  # it coped
        (observe(1, pids_max_hits=3), (Status.PROCESS_LIMIT, "processes", 1, None)),
        (observe(1, "x\nMemoryError\n"), (Status.MEMORY_LIMIT, "memory", 1, None)),
        (
            observe(1, "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
            (Status.PROCESS_LIMIT, "processes", 1, None),
        ),
        (observe(1, "RuntimeError: can't start new thread"), (Status.PROCESS_LIMIT, "processes", 1, None)),
        (observe(1, "OSError: [Errno 27] File too large"), (Status.DISK_LIMIT, "disk", 1, None)),
        (observe(0, is_truncated=True), (Status.OUTPUT_LIMIT, "output", 0, None)),
        (observe(1, "MemoryError", is_truncated=True), (Status.OUTPUT_LIMIT, "output", 1, None)),
        (
            observe(None, is_deadline_hit=True, oom_kills=2),
            (Status.MEMORY_LIMIT, "memory", None, signal.SIGKILL),
        ),  # the cause, not the clock
        (observe(1, compile_error="SyntaxError: x", has_started=False), (Status.COMPILE_ERROR, None, 1, None)),
    ],
)
def test_classify(seen: Observation, expected: tuple) -> None:
    assert classify(seen) == expected


def test_only_a_missing_start_line_is_an_infra_error() -> None:
    assert classify(observe(1, "bwrap: oops"))[0] is Status.NONZERO_EXIT
    not_started = observe(1, "bwrap: execvp /x: No such file", has_started=False)
    assert classify(not_started)[0] is Status.INFRA_ERROR
    assert classify(observe(None, has_started=False, is_deadline_hit=True))[0] is Status.INFRA_ERROR
    # init vanished after the program started: the program shares its limits and memory
    assert classify(observe(None))[0] is Status.KILLED
    assert classify(observe(None, oom_kills=None))[0] is Status.KILLED


def judged(returncode: int | None, candidate: int | None = None, **overrides: object) -> Observation:
    fields: dict[str, object] = {"candidate_cpu_s": None if candidate is None else 0.1, **overrides}
    return observe(returncode, is_judged=True, candidate_returncode=candidate, **fields)


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        # nothing the candidate can produce is infra: its own SIGKILL (a lowered hard CPU limit),
        # its exits, even the judge's own codes when the candidate's process sends them
        (judged(EXIT_CANDIDATE_GONE, KILLED), Status.KILLED),
        (judged(KILLED), Status.KILLED),  # the judge killed: by what? the pool's retry decides
        (judged(EXIT_CANDIDATE_GONE, EXIT_CANDIDATE_NOT_STARTED), Status.NONZERO_EXIT),
        (judged(EXIT_CANDIDATE_GONE, 70), Status.NONZERO_EXIT),
        (judged(EXIT_CANDIDATE_GONE, 0), Status.OK),  # os._exit(0) mid-run: the harness says incomplete
        (judged(EXIT_CANDIDATE_GONE, -signal.SIGSEGV), Status.NONZERO_EXIT),
        (judged(0, KILLED), Status.OK),  # killed after every answer was in: the judge's verdict stands
        (judged(None), Status.KILLED),
        # limits explain a SIGKILL: the candidate's own CPU time, the cgroup's OOM counter
        (judged(EXIT_CANDIDATE_GONE, KILLED, candidate_cpu_s=6.0), Status.TIMEOUT),
        (judged(EXIT_CANDIDATE_GONE, KILLED, oom_kills=1), Status.MEMORY_LIMIT),
        (judged(KILLED, oom_kills=None), Status.MEMORY_LIMIT),
        # only the judge's word on its candidate's trusted start-up, and a missing start line
        (judged(EXIT_CANDIDATE_NOT_STARTED), Status.INFRA_ERROR),
        (judged(1, has_started=False), Status.INFRA_ERROR),
    ],
)
def test_who_is_blamed_in_a_judged_job(seen: Observation, expected: Status) -> None:
    assert classify(seen)[0] is expected


def test_memory_error_earlier_in_stderr_does_not_decide() -> None:
    seen = observe(1, "MemoryError handled\nValueError: later failure")
    assert classify(seen)[0] is Status.NONZERO_EXIT


def test_capped_sink_keeps_the_head_and_counts_the_rest() -> None:
    sink = CappedSink(cap_bytes=4)
    for chunk in (b"ab", b"cdef", b"gh"):
        sink.feed(chunk)
    assert bytes(sink.data) == b"abcd" and sink.dropped_bytes == 4 and sink.is_truncated
