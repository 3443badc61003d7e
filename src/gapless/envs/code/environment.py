"""Code environment: a completion passes the hidden tests of its task inside the sandbox.

Every task runs as a judged job (sandbox/boot.py): two processes in one sandbox.
    judge      the harness (trusted): holds the tests (files under /work/job/judge), the report
               pipe (fd 3) and the comparison; calls the completion's entry point through a
               proxy (envs/code/sandbox_scripts/judge.py)
    candidate  its own process, pid namespace and mount namespace (the tests' directory is
               covered by an empty mount), no capabilities, the syscall filter: loads prompt +
               completion and answers each call with plain values (envs/code/sandbox_scripts/candidate.py) over a
               socket; one line of bounded JSON each way (envs/code/values.py)
A task (`SandboxedTask`) names its harness and its tests:
    io       `envs/code/sandbox_scripts/io_harness.py` calls the entry point on each test's arguments and reports the
             output; the host compares it with the expected output (canonical JSON, so `True` is
             not `1`). Neither process ever sees the expected outputs.
    asserts  `envs/code/sandbox_scripts/assert_harness.py` runs each test's source (assert statements, or a `check(candidate)`
             function as in HumanEval) in the judge, in a namespace made from the prompt alone,
             with the entry point as a proxy, and reports which ones finished without raising;
             every expected output is `true`. A task whose every test is one
             `assert f(<literals>) == <literal>` is instead run as calls whose typed results the
             host compares with `==` (envs/code/asserts.py): no test code enters the sandbox at all.
reward = fraction of tests passed (`reward="pass_fraction"`) or 1/0 for all/not all
(`reward="all_pass"`). Every rollout gets one status, named as the sandbox's `Status` where one fits:
    ok                  all tests pass
    wrong_answer        the program ran and reported every test; some failed or raised
    compile_error       the completion does not compile
    harness_incomplete  the candidate's process ended before every test was reported (an
                        exception at import, exit(0) at import, os._exit(0))
    malformed_report    the report held a line the host could not parse within its bounds
    timeout, memory_limit, process_limit, disk_limit, inode_limit, output_limit: that limit
    killed              the judge or the candidate's process died in a way no limit and no act
                        of the host explains, on two slots in a row (e.g. it lowered its own
                        hard CPU limit): reward 0, never masked
    infra_error         the sandbox failed before any code of the completion ran (after its own
                        retry on another slot); only host-side evidence says so (sandbox/result.py)
What a completion can do to its reward: only answer the calls. Patching builtins, forging
`__eq__`, walking frames or gc, writing fd 3 (in its process, the channel to the judge), exiting,
signalling, reading files or /proc: none reaches the tests, the comparison or the report
(tests/unit/test_sandbox_integrity.py has each attempt and the status it gets).
Model output is untrusted: it only ever becomes a reward and a status; `parse_report` never
raises; nothing the completion does (exit, signals, limits, output) makes a rollout
`infra_error` (docs/sandbox.md, "Who is blamed"). `infra_error` rollouts are excluded from group statistics by the advantage function
(never scored 0), and `check_infra` raises `SandboxUnavailable` when a whole step failed that
way, instead of training on fake zeros. The record (`Rollout.info`) keeps the sandbox status,
the limit hit, wall and CPU time, the slot, the attempts and the tail of stdout.
Identical completions of one prompt are executed once (the result is deterministic input/output).
Code tasks need bubblewrap: in reduced mode the candidate could read the tests, so the
environment refuses to start there.
NOT guaranteed: values cross as builtin types (a test that checks an argument was not mutated,
or that uses a name only the completion defines, is not meaningful); timing side channels.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, NamedTuple, Protocol, Sequence

from gapless.config import ConfigError
from gapless.envs.base import InfraUnavailable, Split, check_infra
from gapless.envs.code.asserts import host_compared
from gapless.envs.code.values import Malformed, decode, loads_bounded
from gapless.sandbox import BwrapSandbox, Judged, SandboxLimits, SandboxResult, Status
from gapless.types import Completion, Rollout

_HERE = Path(__file__).parent
SCRIPTS = _HERE / "sandbox_scripts"  # run inside the sandbox: shipped as text, never imported here
HARNESSES = {"io": (SCRIPTS / "io_harness.py").read_text(), "asserts": (SCRIPTS / "assert_harness.py").read_text()}


def _with_bytecode(files: dict[str, str]) -> dict[str, str | bytes]:
    """Each module with its bytecode beside it (`__pycache__`, unchecked hash-based pyc, PEP 552),
    so the judge and the candidate do not compile them again in every job. A sandbox python of
    another version ignores a pyc whose magic number or cache tag is not its own."""
    shipped: dict[str, str | bytes] = dict(files)
    for name, source in files.items():
        data = source.encode("utf-8")
        code = compile(data, name, "exec", dont_inherit=True)
        pyc = importlib._bootstrap_external._code_to_hash_pyc(code, importlib.util.source_hash(data), False)
        shipped[f"__pycache__/{name[:-3]}.{sys.implementation.cache_tag}.pyc"] = bytes(pyc)
    return shipped


JUDGE_FILES = _with_bytecode(
    {  # shipped with every judged job, under the names the harnesses import
        "gapless_values.py": (_HERE / "values.py").read_text(),
        "gapless_judge.py": (SCRIPTS / "judge.py").read_text(),
        "gapless_candidate.py": (SCRIPTS / "candidate.py").read_text(),
    }
)
JUDGED = Judged(candidate="gapless_candidate.py", private="judge")
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


def parse_report(report: bytes, expected: tuple[str, ...], typed_expected: tuple[object, ...] | None = None) -> Report:
    """Read the report channel; never raises, whatever the bytes (a property test checks it).
    `expected`: canonical JSON per test, compared with the record's `out`; `typed_expected`
    (host-compared asserts, envs/code/asserts.py): values compared with `==` to the record's
    `value`, a typed plain value (code_values.decode)."""
    records: dict[int, dict] = {}
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
            if type(index) is int and 0 <= index < len(expected) and index not in records:
                records[index] = record
        except (Malformed, ValueError, TypeError, RecursionError):
            malformed += 1
    passed = 0
    for index, record in records.items():
        try:
            if typed_expected is None:
                passed += "out" in record and json.dumps(record["out"], sort_keys=True) == expected[index]
            elif type(record.get("value")) is str:
                passed += bool(decode(record["value"]) == typed_expected[index])  # builtin values only
        except (Malformed, ValueError, TypeError, RecursionError):
            malformed += 1
    return Report(passed, len(records) == len(expected), compile_error, malformed)


class CodeEnvironment:
    """An `Environment` over sandboxed code tasks. `splits` maps "train"/"eval" to its tasks;
    `retries`: extra attempts after an infra_error, on top of the sandbox's own retry on
    another slot (so 0 already means two attempts on two slots)."""

    def __init__(
        self,
        sandbox: BwrapSandbox,
        limits: SandboxLimits,
        concurrency: int = 4,
        retries: int = 0,
        splits: dict[str, Sequence[SandboxedTask]] | None = None,
        name: str = "code",
        reward: RewardMode = "pass_fraction",
    ):
        if getattr(sandbox, "mode", "bwrap") == "reduced":
            reason = getattr(sandbox, "reason", "reduced mode requested")
            sandbox.close()
            raise ConfigError(
                f"code tasks need bubblewrap, but the sandbox is in reduced mode ({reason}), where the "
                "program could read its own tests: install bubblewrap (apt-get install bubblewrap) and "
                "set sandbox.mode = 'bwrap' or 'auto'")  # fmt: skip
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

    def score_groups(
        self, problems: Sequence[SandboxedTask], groups: Sequence[Sequence[Completion]]
    ) -> list[list[Rollout]]:
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
        program = problem.program(text)
        try:
            program.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no file can hold it, no program is it
            return 0.0, Status.COMPILE_ERROR.value, {"passed": 0, "error": f"not UTF-8 text: {exc.reason}"}
        files = {
            "harness.py": HARNESSES[problem.harness],
            **JUDGE_FILES,
            "solution.py": program,
            "judge/tests.json": "[" + ",".join(problem.test_inputs) + "]",
        }
        args = [problem.entry_point]
        host = host_compared(problem.entry_point, problem.test_inputs) if problem.harness == "asserts" else None
        if host is not None:  # calls whose results the host compares: no test code in the sandbox
            files["harness.py"], args = HARNESSES["io"], [problem.entry_point, "typed"]
            files["judge/tests.json"] = "\n".join(host.args)
        elif problem.harness == "asserts":
            files["judge/prompt.py"] = problem.prompt
        for _attempt in range(self.retries + 1):
            result = self.sandbox.run_python(files, "harness.py", args, self.limits, judged=JUDGED)
            if result.status is not Status.INFRA_ERROR:
                break
        info = _record(result)
        if result.status is Status.INFRA_ERROR:  # no reward at all: masked from the group
            return (
                0.0,
                Status.INFRA_ERROR.value,
                {**info, "error": result.stderr.strip()[:300] + " (run `gapless sandbox check`)"},
            )
        typed_expected = host.expected if host is not None else None
        passed, complete, compile_error, malformed = parse_report(result.report, problem.test_outputs, typed_expected)
        reward = passed / len(problem.test_outputs)
        info["passed"] = passed
        if compile_error is not None:
            return 0.0, Status.COMPILE_ERROR.value, info
        if malformed:  # the judge writes only bounded records: something broke the channel
            return 0.0, MALFORMED_REPORT, {**info, "malformed_lines": malformed}
        if result.status is Status.KILLED:  # its own doing (sandbox/result.py): never masked
            return 0.0, Status.KILLED.value, info
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
