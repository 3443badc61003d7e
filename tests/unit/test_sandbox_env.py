"""The code environment over the sandbox: statuses from the documented set, and an
infrastructure failure never becomes a reward."""

from __future__ import annotations

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.envs.code.environment import CodeEnvironment, SandboxUnavailable
from gapless.envs.code.problems import CodeProblem
from gapless.sandbox import BwrapSandbox, SandboxLimits, SandboxResult, Status
from gapless.trainer.advantages import group_advantages
from gapless.types import Completion

PROBLEM = CodeProblem(uid="p", level=1, prompt="def f(x):\n    return ", solution="x + 1", overfit_solution="abs(x) + 1",
                      entry_point="f", test_inputs=("[1]", "[2]"), test_outputs=("2", "3"))  # fmt: skip


def completion(text: str) -> Completion:
    return Completion([1], [2], [0.0], [0], "stop", text)


class BrokenSandbox:
    """A sandbox whose every run fails for infrastructure reasons."""

    def run_python(self, files, main, args=(), limits=None, judged=None) -> SandboxResult:
        return SandboxResult(Status.INFRA_ERROR, None, None, "", "bwrap: cannot fork", 0.0,
                             False, None, b"", attempts=2)  # fmt: skip

    def close(self) -> None:
        pass


def test_infra_failures_are_masked_not_scored():
    env = CodeEnvironment(BrokenSandbox(), SandboxLimits(), concurrency=2)  # type: ignore[arg-type]
    try:
        rollouts = env.score(PROBLEM, [completion("x + 1"), completion("x")])
        assert [r.status for r in rollouts] == ["infra_error", "infra_error"]
        assert all(r.is_infra_failure and r.info["attempts"] == 2 for r in rollouts)
        with pytest.raises(SandboxUnavailable, match="sandbox check"):
            env.check_infra(rollouts)
        advantages = group_advantages([1.0, 0.0, 0.0], [True, False, False])
        assert advantages.advantages == [0.0, 0.0, 0.0] and advantages.valid == [True, False, False]
    finally:
        env.close()


@needs_bwrap
def test_statuses_of_real_runs(clean_host):
    box = BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=2)
    env = CodeEnvironment(box, SandboxLimits(timeout_s=2.0), concurrency=2)
    try:
        cases = {
            "x + 1": ("ok", 1.0),
            "x": ("wrong_answer", 0.0),
            "x +": ("compile_error", 0.0),
            "0\nimport sys\nsys.exit(0)": ("harness_incomplete", 0.0),
            "0\nwhile True:\n    pass": ("timeout", 0.0),
            "0\nblock = bytearray(8 << 30)": ("memory_limit", 0.0),
        }
        rollouts = env.score(PROBLEM, [completion(text) for text in cases])
        for rollout, (text, (status, reward)) in zip(rollouts, cases.items()):
            assert (rollout.status, rollout.reward) == (status, reward), text
            assert rollout.info["sandbox_status"] in {s.value for s in Status}
    finally:
        env.close()  # closes the sandbox too
