"""Code environment: a completion passes the hidden tests of its task inside the sandbox.

A task (`SandboxedTask`) names its harness and its tests. Two harnesses run in the sandbox:
    io       `code_harness.py` calls the entry point on each test's arguments and reports the
             output; the host compares it with the expected output (canonical JSON, so `True` is
             not `1`). The harness never sees the expected outputs.
    asserts  `assert_harness.py` runs each test's source (assert statements, or a `check(candidate)`
             function as in HumanEval) against the entry point and reports which ones finished
             without raising; every expected output is `true`.
reward = fraction of tests passed (`reward="pass_fraction"`) or 1/0 for all/not all
(`reward="all_pass"`). Every rollout gets one status, named as the sandbox's `Status` where one fits:
    ok                  all tests pass
    wrong_answer        the program ran and reported every test; some failed or raised
    compile_error       the completion does not compile
    harness_incomplete  the program ended before reporting every test (an exception at import,
                        exit(0), os._exit(0), printed fake results: the host compares outputs
                        itself, so none of these passes a test it did not solve)
    timeout, memory_limit, process_limit, disk_limit, inode_limit, output_limit: that limit
    infra_error         the sandbox failed (after its own retry on another slot)
Model output is untrusted: it only ever becomes a reward and a status. `infra_error` rollouts are
excluded from group statistics by the advantage function (never scored 0), and `check_infra`
raises `SandboxUnavailable` when a whole step failed that way, instead of training on fake
zeros. The record (`Rollout.info`) keeps the sandbox status, the limit hit, wall and CPU time,
the slot, the attempts and the tail of stdout.
Identical completions of one prompt are executed once (the result is deterministic input/output).
Not guaranteed: with the `asserts` harness the tests run in the candidate's own process, so a
candidate written to forge the report channel (fd 3) can claim tests it did not pass; the `io`
harness does not have this hole because the host holds the expected outputs.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, NamedTuple, Protocol, Sequence

from gapless.envs.base import InfraUnavailable, Split, check_infra
from gapless.envs.code_values import Malformed, loads_bounded
from gapless.sandbox import BwrapSandbox, SandboxLimits, SandboxResult, Status
from gapless.types import Completion, Rollout

HARNESSES = {
    "io": (Path(__file__).parent / "code_harness.py").read_text(),
    "asserts": (Path(__file__).parent / "assert_harness.py").read_text(),
}
RewardMode = Literal["pass_fraction", "all_pass"]
MALFORMED_REPORT = "malformed_report"
_LIMIT_STATUSES = {
    Status.TIMEOUT, Status.MEMORY_LIMIT, Status.PROCESS_LIMIT, Status.DISK_LIMIT,
    Status.INODE_LIMIT, Status.OUTPUT_LIMIT, Status.COMPILE_ERROR,
}  # fmt: skip


class SandboxUnavailable(InfraUnavailable):
    """The sandbox failed for infrastructure reasons on every retry; fix the host, not the model."""


class SandboxedTask(Protocol):
    """What the code environment needs from a task (procedural problems and dataset rows alike)."""

    uid: str
    prompt: str
    entry_point: str
    harness: str  # "io" or "asserts"
    test_inputs: tuple[str, ...]  # JSON, one per test: an argument list (io) or a test source (asserts)
    test_outputs: tuple[str, ...]  # canonical JSON of the expected output per test

    def program(self, completion: str) -> str: ...


class Report(NamedTuple):
    """What the host read from the report channel (untrusted: every field is bounded)."""

    passed: int  # tests whose reported output equals the expected one
    is_complete: bool  # every test reported
    compile_error: str | None
    malformed: int  # lines that were not a bounded JSON record (code_values.loads_bounded)


def parse_report(report: bytes, expected: tuple[str, ...]) -> Report:
    """Read the report channel; never raises, whatever the bytes (a property test checks it)."""
    outputs: dict[int, str] = {}
    compile_error = None
    malformed = 0
    for raw in report.splitlines():
        if not raw.strip():
            continue
        try:
            record = loads_bounded(raw)
            if not isinstance(record, dict):
                raise Malformed("not a record")
            if "compile_error" in record and compile_error is None:
                compile_error = str(record["compile_error"])[:500]
            index = record.get("i")
            if type(index) is int and 0 <= index < len(expected) and index not in outputs:
                outputs[index] = json.dumps(record["out"], sort_keys=True) if "out" in record else "<error>"
        except (Malformed, ValueError, TypeError, RecursionError):
            malformed += 1
    passed = sum(1 for i, want in enumerate(expected) if outputs.get(i) == want)
    return Report(passed, len(outputs) == len(expected), compile_error, malformed)


class CodeEnvironment:
    """An `Environment` over sandboxed code tasks. `splits` maps "train"/"eval" to its tasks;
    `retries`: extra attempts after an infra_error, on top of the sandbox's own retry on
    another slot (so 0 already means two attempts on two slots)."""

    def __init__(self, sandbox: BwrapSandbox, limits: SandboxLimits, concurrency: int = 4, retries: int = 0,
                 splits: dict[str, Sequence[SandboxedTask]] | None = None, name: str = "code",
                 reward: RewardMode = "pass_fraction"):
        self.sandbox = sandbox
        self.limits = limits
        self.retries = retries
        self.name = name
        self.reward_mode = reward
        self.splits = dict(splits or {})
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox")

    def tasks(self, split: Split) -> Sequence[SandboxedTask]:
        return self.splits.get(split, [])

    def metrics(self) -> dict[str, float]:
        return self.sandbox.metrics()

    def score(self, problem: SandboxedTask, completions: list[Completion]) -> list[Rollout]:
        return self.score_groups([problem], [completions])[0]

    def score_groups(self, problems: Sequence[SandboxedTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        """Score every group at once (all distinct programs in flight together), keeping order."""
        futures = {}
        for problem, completions in zip(problems, groups):
            for c in completions:
                key = grading_key(problem, c.text)
                if key not in futures:
                    futures[key] = self.pool.submit(self.score_text, problem, c.text)
        results = {key: fut.result() for key, fut in futures.items()}
        return [[Rollout(p.uid, c, *results[grading_key(p, c.text)]) for c in cs] for p, cs in zip(problems, groups)]

    def score_text(self, problem: SandboxedTask, text: str) -> tuple[float, str, dict]:
        reward, status, info = self._run_tests(problem, text)
        if self.reward_mode == "all_pass" and status != Status.INFRA_ERROR.value:
            reward = 1.0 if status == "ok" else 0.0
        return reward, status, info

    def _run_tests(self, problem: SandboxedTask, text: str) -> tuple[float, str, dict]:
        files = {
            "harness.py": HARNESSES[problem.harness],
            "solution.py": problem.program(text),
            "tests.json": "[" + ",".join(problem.test_inputs) + "]",
        }
        for _attempt in range(self.retries + 1):
            result = self.sandbox.run_python(files, "harness.py", [problem.entry_point], self.limits)
            if result.status is not Status.INFRA_ERROR:
                break
        info = _record(result)
        if result.status is Status.INFRA_ERROR:  # no reward at all: masked from the group
            return 0.0, Status.INFRA_ERROR.value, {**info, "error": result.stderr.strip()[:300] + " (run `gapless sandbox check`)"}
        passed, complete, compile_error, malformed = parse_report(result.report, problem.test_outputs)
        reward = passed / len(problem.test_outputs)
        info["passed"] = passed
        if compile_error is not None:
            return 0.0, Status.COMPILE_ERROR.value, info
        if malformed:  # the judge writes only bounded records: something broke the channel
            return 0.0, MALFORMED_REPORT, {**info, "malformed_lines": malformed}
        if result.status in _LIMIT_STATUSES:
            return reward, result.status.value, info
        if not complete:
            return reward, Status.HARNESS_INCOMPLETE.value, info
        return reward, "ok" if passed == len(problem.test_outputs) else "wrong_answer", info

    @staticmethod
    def check_infra(rollouts: list[Rollout]) -> int:
        """Count infra failures; raise when no rollout could be scored at all."""
        try:
            return check_infra(rollouts)
        except InfraUnavailable as exc:
            raise SandboxUnavailable(f"{exc}; the sandbox failed to start: run `gapless sandbox check`") from None

    def close(self) -> None:
        """Stop scoring and close the sandbox (its servers and cgroups)."""
        self.pool.shutdown(wait=True)
        self.sandbox.close()


def grading_key(problem: SandboxedTask, text: str) -> tuple:
    """What decides a grade: the program as run and everything it is tested with, never the uid
    (two problems that share a uid but not their tests never share a result)."""
    return problem.harness, problem.entry_point, problem.test_inputs, problem.test_outputs, problem.program(text)


def _record(result: SandboxResult) -> dict:
    return {
        "sandbox_status": result.status.value,
        "limit": result.limit,
        "wall_s": result.wall_s,
        "cpu_s": result.cpu_s,
        "slot": result.slot,
        "attempts": result.attempts,
        "stdout_tail": result.stdout[-500:],  # what the program printed (tests report on fd 3)
    }
