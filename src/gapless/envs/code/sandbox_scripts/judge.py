"""Runs inside the sandbox, in the judge's process: its side of the channel to the candidate.

A judged job (envs/code/environment.py, sandbox/boot.py) has two processes. The judge runs this module and a
harness (envs/code/sandbox_scripts/io_harness.py or envs/code/sandbox_scripts/assert_harness.py); it alone holds the tests (files under
/work/job/judge, which the candidate's mount namespace hides), the report pipe (fd 3) and the
comparison. The candidate's process runs the completion (envs/code/sandbox_scripts/candidate.py) and answers calls on
a socket (the judge's fd 5) with plain values: one line of JSON each way (envs/code/values.py).

Start-up handshake (`connect`): the candidate's process, still running trusted code only, says
`up` and waits; the judge answers `go` from its main, so after its own start-up line is on the
status pipe; only then does the candidate load the completion and say `ready` (or its compile
error). So no code of the completion runs before the judge has started (the host's
"not started" is never the candidate's doing), and a channel that closes before `up` is a
failure of trusted start-up: the judge exits `EXIT_CANDIDATE_NOT_STARTED`, the one exit the host
reads as infra_error (sandbox/result.py). The completion cannot reach it: `up` is read before
`go` is sent, and nothing of the completion runs before `go`.

`Candidate.call(name, args, kwargs)` sends a call and returns the decoded result, a value built
by `decode` from builtin types only, or raises `CandidateFailed` (the candidate raised, whatever
the exception: `StopIteration`, `GeneratorExit`, `KeyboardInterrupt`, `SystemExit` or any other;
or its answer was not a value) or `CandidateGone` (the channel closed). Both are BaseExceptions
that carry no protocol meaning (a `StopIteration` re-raised here would end a test's `map` early,
as if the candidate's answers were all in), and both are also recorded on the `Candidate`
(`failure`, `is_gone`): the harness fails the test whatever the test's own code did with the
exception (caught it, suppressed it in a context manager, lost it in a generator). The judge
runs the test's control flow, never the candidate's. When the channel is closed the harness
stops reporting and exits `EXIT_CANDIDATE_GONE`; init waits for the candidate's process and
reports how it ended (boot.py), so the host can classify the candidate's own end.

Guaranteed: whatever the candidate writes, a call ends in a value, one of those exceptions, or
the run's deadline. NOT guaranteed: a candidate that never answers holds the run to its
deadline; mutations the candidate makes to its copy of an argument do not reach the test; a
test that expects the entry point to raise cannot pass (every exception is a failure).
Not standalone-safe: run only inside the sandbox.
"""

import json
import os
import sys

import gapless_values as values

FD_REPORT, FD_CANDIDATE = 3, 5
EXIT_CANDIDATE_GONE = 75
EXIT_CANDIDATE_NOT_STARTED = 76  # sandbox/result.py reads it as infra_error: see the module docstring
PRIVATE_DIR = "/work/job/judge"
MAX_STRAY_LINES = 64  # lines without the awaited call's number before the call fails


class CandidateGone(BaseException):
    """The candidate's process closed the channel (it exited, was killed, or closed fd 3)."""


class CandidateFailed(BaseException):
    """A call that did not return a value: the candidate raised (any exception), or answered
    with something that is not a value. A BaseException, so `except Exception` in a test does
    not swallow it; the failure is recorded on the `Candidate` in any case."""


class Candidate:
    def __init__(self, fd: int = FD_CANDIDATE) -> None:
        self.channel = values.LineChannel(fd)
        self._seq = 0
        self.failure: str | None = None  # the first failed call since `begin_test`
        self.is_gone = False  # the channel closed; stays so

    def begin_test(self) -> None:
        self.failure = None

    def start(self) -> str | None:
        """The handshake (module docstring); the completion's compile error, if any. Exits
        `EXIT_CANDIDATE_NOT_STARTED` if the channel closes before `up`."""
        if self.channel.receive() != b'["up"]':  # only trusted code has run there: not its doing
            sys.exit(EXIT_CANDIDATE_NOT_STARTED)
        try:
            self.channel.send(values.encode(["go"]))
        except OSError:
            self._gone("the candidate closed the channel")
        line = self.channel.receive()
        if line is None:
            self._gone("the candidate ended before it was ready")
        try:
            message = values.decode(line)
        except values.Malformed:
            self._gone("the candidate's first message was not a value")
        if type(message) is list and message[:1] == ["compile_error"] and len(message) == 2:
            return str(message[1])[:500]
        if message != ["ready"]:
            self._gone("the candidate's first message was not `ready`")
        return None

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        if self.is_gone:
            raise CandidateGone("the candidate closed the channel")
        try:
            return self._call(name, args, kwargs)
        except CandidateGone:
            self.is_gone = True
            raise
        except BaseException as failure:  # noqa: BLE001 -- recorded, then the test's to unwind
            if self.failure is None:
                self.failure = str(failure)[:100] or type(failure).__name__
            raise CandidateFailed(self.failure) from None

    def _call(self, name: str, args: tuple, kwargs: dict) -> object:
        self._seq += 1
        try:
            request = values.encode([self._seq, name, list(args), dict(kwargs)])
        except values.Unrepresentable as error:  # a test's own argument: the test fails
            raise CandidateFailed(f"argument has no plain-data form: {error}") from None
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
                raise CandidateFailed("the candidate's answer was not a value") from None
            if type(answer) is list and len(answer) == 3 and answer[0] == self._seq:
                return _result(answer[1], answer[2])
        raise CandidateFailed("the candidate did not answer the call")

    def _gone(self, why: str) -> None:
        self.is_gone = True
        raise CandidateGone(why)


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
    name = body if kind == "e" and type(body) is str and body.isidentifier() else "an answer that is not a value"
    raise CandidateFailed(name[:100])


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
