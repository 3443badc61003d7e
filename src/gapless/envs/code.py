"""Code environment: a completion passes the hidden tests of its problem inside the sandbox.

reward = fraction of hidden tests whose output equals the expected output (canonical JSON, so
`True` is not `1`). Every rollout gets one status, named as the sandbox's `Status` where one fits:
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
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gapless.envs.problems import CodeProblem
from gapless.sandbox import BwrapSandbox, SandboxLimits, SandboxResult, Status
from gapless.types import Completion, Rollout

HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_LIMIT_STATUSES = {
    Status.TIMEOUT, Status.MEMORY_LIMIT, Status.PROCESS_LIMIT, Status.DISK_LIMIT,
    Status.INODE_LIMIT, Status.OUTPUT_LIMIT, Status.COMPILE_ERROR,
}  # fmt: skip


class SandboxUnavailable(RuntimeError):
    """The sandbox failed for infrastructure reasons on every retry; fix the host, not the model."""


def parse_report(report: bytes, expected: tuple[str, ...]) -> tuple[int, bool, str | None]:
    """(tests passed, all tests reported, compile error) from the untrusted report channel."""
    outputs: dict[int, str] = {}
    compile_error = None
    for raw in report.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if "compile_error" in record and compile_error is None:
            compile_error = str(record["compile_error"])[:500]
        index = record.get("i")
        if isinstance(index, int) and 0 <= index < len(expected) and index not in outputs:
            outputs[index] = json.dumps(record["out"], sort_keys=True) if "out" in record else "<error>"
    passed = sum(1 for i, want in enumerate(expected) if outputs.get(i) == want)
    return passed, len(outputs) == len(expected), compile_error


class CodeEnvironment:
    """`retries`: extra attempts after an infra_error, on top of the sandbox's own retry on
    another slot (so 0 already means two attempts on two slots)."""

    def __init__(self, sandbox: BwrapSandbox, limits: SandboxLimits, concurrency: int = 4, retries: int = 0):
        self.sandbox = sandbox
        self.limits = limits
        self.retries = retries
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox")

    def score(self, problem: CodeProblem, completions: list[Completion]) -> list[Rollout]:
        return self.score_groups([problem], [completions])[0]

    def score_groups(self, problems: list[CodeProblem], groups: list[list[Completion]]) -> list[list[Rollout]]:
        """Score every group at once (all distinct programs in flight together), keeping order."""
        futures = {}
        for problem, completions in zip(problems, groups):
            for c in completions:
                key = (problem.uid, c.text)
                if key not in futures:
                    futures[key] = self.pool.submit(self.score_text, problem, c.text)
        results = {key: fut.result() for key, fut in futures.items()}
        return [[Rollout(p.uid, c, *results[(p.uid, c.text)]) for c in cs] for p, cs in zip(problems, groups)]

    def score_text(self, problem: CodeProblem, text: str) -> tuple[float, str, dict]:
        files = {
            "harness.py": HARNESS,
            "solution.py": problem.program(text),
            "tests.json": "[" + ",".join(problem.test_inputs) + "]",
        }
        for _attempt in range(self.retries + 1):
            result = self.sandbox.run_python(files, "harness.py", [problem.entry_point], self.limits)
            if result.status is not Status.INFRA_ERROR:
                break
        info = _record(result)
        if result.status is Status.INFRA_ERROR:  # no reward at all: masked from the group
            return 0.0, Status.INFRA_ERROR.value, {**info, "error": result.stderr.strip()[:300]}
        passed, complete, compile_error = parse_report(result.report, problem.test_outputs)
        reward = passed / len(problem.test_outputs)
        info["passed"] = passed
        if compile_error is not None:
            return 0.0, Status.COMPILE_ERROR.value, info
        if result.status in _LIMIT_STATUSES:
            return reward, result.status.value, info
        if not complete:
            return reward, Status.HARNESS_INCOMPLETE.value, info
        return reward, "ok" if passed == len(problem.test_outputs) else "wrong_answer", info

    @staticmethod
    def check_infra(rollouts: list[Rollout]) -> int:
        """Count infra failures; raise when no rollout could be scored at all."""
        failures = sum(r.is_infra_failure for r in rollouts)
        if rollouts and failures == len(rollouts):
            detail = rollouts[0].info.get("error", "")
            raise SandboxUnavailable(f"every sandbox run of this step failed to start ({detail}); run `gapless sandbox check`")
        return failures

    def close(self) -> None:
        """Stop scoring and close the sandbox (its servers and cgroups)."""
        self.pool.shutdown(wait=True)
        self.sandbox.close()


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
