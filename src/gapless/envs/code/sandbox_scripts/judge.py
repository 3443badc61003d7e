"""Runs inside the sandbox, in the judge's process: its side of the channel to the candidate.

A judged job (envs/code/environment.py, sandbox/boot.py) has two processes. The judge runs this module and a
harness (envs/code/sandbox_scripts/io_harness.py or envs/code/sandbox_scripts/assert_harness.py); it alone holds the tests (files under
/work/job/judge, which the candidate's mount namespace hides), the report pipe (fd 3) and the
comparison. The candidate's process runs the completion (envs/code/sandbox_scripts/candidate.py) and answers calls on
a socket (the judge's fd 5) with plain values: one line of JSON each way (envs/code/values.py).

`Candidate.call(name, args, kwargs)` sends a call and returns the decoded result, a value
built by `decode` from builtin types only, or raises: the builtin exception the candidate named
(so a test may expect a `ValueError`), `CandidateError` for any other failure, `CandidateGone`
(a BaseException, so no test's `except Exception` swallows it) when the channel is closed. The
harness then stops reporting and exits `EXIT_CANDIDATE_GONE`; init waits for the candidate's
process and reports how it ended (boot.py), so the host can tell an exit of the candidate's own
from a kill from outside (sandbox/result.py).

Guaranteed: whatever the candidate writes, a call ends in a value, one of those exceptions, or
the run's deadline. NOT guaranteed: a candidate that never answers holds the run to its
deadline; mutations the candidate makes to its copy of an argument do not reach the test.
Not standalone-safe: run only inside the sandbox.
"""

import builtins
import json
import os
import sys

import gapless_values as values

FD_REPORT, FD_CANDIDATE = 3, 5
EXIT_CANDIDATE_GONE = 75
PRIVATE_DIR = "/work/job/judge"
MAX_STRAY_LINES = 64  # lines without the awaited call's number before the call fails


class CandidateGone(BaseException):
    """The candidate's process closed the channel (it exited, was killed, or closed fd 3)."""


class CandidateError(Exception):
    """The candidate's answer to a call was not a value (an exception of its own, or garbage)."""


class Candidate:
    def __init__(self, fd: int = FD_CANDIDATE) -> None:
        self.channel = values.LineChannel(fd)
        self._seq = 0

    def start(self) -> str | None:
        """Wait for the candidate's program to load; its compile error, if any."""
        line = self.channel.receive()
        if line is None:
            raise CandidateGone("the candidate ended before it was ready")
        try:
            message = values.decode(line)
        except values.Malformed:
            raise CandidateGone("the candidate's first message was not a value") from None
        if type(message) is list and message[:1] == ["compile_error"] and len(message) == 2:
            return str(message[1])[:500]
        if message != ["ready"]:
            raise CandidateGone("the candidate's first message was not `ready`")
        return None

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        self._seq += 1
        try:
            request = values.encode([self._seq, name, list(args), dict(kwargs)])
        except values.Unrepresentable as error:  # a test's own argument: the test fails
            raise CandidateError(f"argument has no plain-data form: {error}") from None
        try:
            self.channel.send(request)
        except OSError:
            raise CandidateGone("the candidate closed the channel") from None
        for _ in range(MAX_STRAY_LINES):
            line = self.channel.receive()
            if line is None:
                raise CandidateGone("the candidate closed the channel")
            try:
                answer = values.decode(line)
            except values.Malformed:
                raise CandidateError("the candidate's answer was not a value") from None
            if type(answer) is list and len(answer) == 3 and answer[0] == self._seq:
                return _result(answer[1], answer[2])
        raise CandidateError("the candidate did not answer the call")


class Proxy:
    """Stands for the candidate's function `name` in the judge: plain values in, plain out."""

    def __init__(self, candidate: Candidate, name: str) -> None:
        self._candidate = candidate
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        return self._candidate.call(self.__name__, args, kwargs)


def _result(kind: object, body: object) -> object:
    if kind == "r":
        return body
    exception = getattr(builtins, body, None) if kind == "e" and type(body) is str else None
    if isinstance(exception, type) and issubclass(exception, Exception):
        raise exception("raised in the candidate's process")
    raise CandidateError(f"the candidate failed: {str(body)[:100]}")


def open_report():
    return os.fdopen(FD_REPORT, "w", buffering=1)


def connect(report) -> Candidate:
    """The candidate, once its program has loaded; on a compile error, report it and exit."""
    candidate = Candidate()
    try:
        compile_error = candidate.start()
    except CandidateGone:
        sys.exit(EXIT_CANDIDATE_GONE)
    if compile_error is not None:
        report.write(json.dumps({"compile_error": compile_error}) + "\n")
        sys.exit(3)
    return candidate


def read_private(name: str) -> str:
    with open(os.path.join(PRIVATE_DIR, name), encoding="utf-8") as handle:
        return handle.read()
