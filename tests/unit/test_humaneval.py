"""HumanEval in the sandbox: every canonical solution passes, empty and truncated ones fail.

The tests run in the judge's process against a proxy of the candidate's entry point (envs/code/environment.py),
so this is the check that the judge, the plain-value boundary and HumanEval's `check(candidate)`
tests agree. The whole set (164 problems x 3 completions) is a `slow` test; the fast suite runs
a representative subset: the first problems, those whose tests use helpers the prompt defines
(`poly`, `encode_cyclic`, `encode_shift`), and those that return tuples, floats or dicts.
"""

import shutil
import time

import pytest
from sandbox_host import SLOT_UID_BASE

from gapless.envs.code.dataset import humaneval_tasks
from gapless.envs.code.environment import CodeEnvironment
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
LIMITS = SandboxLimits(timeout_s=10.0)


def _completion(text: str) -> Completion:
    return Completion([], [], [], [], "stop", text)


SUBSET = {f"HumanEval/{n}" for n in (0, 1, 2, 8, 10, 32, 38, 50, 107, 111, 136, 155, 160)}


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_broken_ones_fail():
    check_humaneval(lambda task: True, expected=164)


def test_humaneval_subset_canonical_solutions_pass_and_broken_ones_fail():
    check_humaneval(lambda task: task.uid in SUBSET, expected=len(SUBSET))


def check_humaneval(selected, expected: int) -> None:
    tasks = humaneval_tasks()
    assert tasks["train"] == [] and len(tasks["eval"]) == 164
    evalset = [task for task in tasks["eval"] if selected(task)]
    assert len(evalset) == expected
    env = CodeEnvironment(BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE, max_concurrency=8), LIMITS, concurrency=8,
                          splits=tasks, name="humaneval")  # fmt: skip
    try:
        started = time.perf_counter()
        groups = env.score_groups(
            evalset,
            [
                [
                    _completion(t.solution),
                    _completion(""),  # empty body: the docstring alone makes the function return None
                    _completion(t.solution[: len(t.solution) // 2]),  # cut mid-way, as at max_new_tokens
                ]
                for t in evalset
            ],
        )
        elapsed = time.perf_counter() - started
    finally:
        env.close()
    canonical = {g[0].prompt_uid: (g[0].reward, g[0].status) for g in groups}
    assert all(v == (1.0, "ok") for v in canonical.values()), {k: v for k, v in canonical.items() if v != (1.0, "ok")}
    for _, empty, truncated in groups:
        assert empty.reward == 0.0 and empty.status in ("wrong_answer", "compile_error"), (
            empty.prompt_uid,
            empty.status,
        )
        assert truncated.reward == 0.0 and truncated.status != "ok", (truncated.prompt_uid, truncated.status)
    print(f"HumanEval: {3 * len(evalset)} programs scored in {elapsed:.1f} s")
    assert elapsed < 120
