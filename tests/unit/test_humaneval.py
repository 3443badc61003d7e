"""HumanEval in the sandbox: every canonical solution passes, empty and truncated ones fail.

The whole set (164 problems x 3 completions) runs here with sandbox concurrency: this is the
check that our assert harness and HumanEval's `check(candidate)` tests agree.
"""

import shutil
import time

import pytest

from gapless.envs.code import CodeEnvironment
from gapless.envs.code_dataset import humaneval_tasks
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
LIMITS = SandboxLimits(timeout_s=10.0)


def _completion(text: str) -> Completion:
    return Completion([], [], [], [], "stop", text)


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail():
    tasks = humaneval_tasks()
    assert tasks["train"] == [] and len(tasks["eval"]) == 164
    evalset = tasks["eval"]
    env = CodeEnvironment(BwrapSandbox(LIMITS, max_concurrency=8), LIMITS, concurrency=8, splits=tasks, name="humaneval")
    try:
        started = time.perf_counter()
        groups = env.score_groups(evalset, [[
            _completion(t.solution),
            _completion(""),  # empty body: the docstring alone makes the function return None
            _completion(t.solution[: len(t.solution) // 2]),  # cut mid-way, as at max_new_tokens
        ] for t in evalset])
        elapsed = time.perf_counter() - started
    finally:
        env.close()
    canonical = {g[0].prompt_uid: (g[0].reward, g[0].status) for g in groups}
    assert all(v == (1.0, "ok") for v in canonical.values()), {k: v for k, v in canonical.items() if v != (1.0, "ok")}
    for _, empty, truncated in groups:
        assert empty.reward == 0.0 and empty.status in ("wrong_answer", "compile_error"), (empty.prompt_uid, empty.status)
        assert truncated.reward == 0.0 and truncated.status != "ok", (truncated.prompt_uid, truncated.status)
    print(f"HumanEval: {3 * len(evalset)} programs scored in {elapsed:.1f} s")
    assert elapsed < 120
