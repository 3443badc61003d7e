"""Harness probes: completions of a tiny code problem that attack the code task's test harness.

They run in `gapless sandbox check` and tests/unit/test_sandbox_hostile.py after the sandbox's own
probes (sandbox/probes.py), with the same host traps (`run_probe`); each is scored by the code
environment, so its status is the environment's (`harness_incomplete`, `wrong_answer`), not the
sandbox's. In reduced mode the code environment refuses to start, and each reports `refused`.
"""

from __future__ import annotations

from gapless.envs.code.environment import CodeEnvironment
from gapless.envs.code.problems import CodeProblem
from gapless.sandbox.bwrap import BwrapSandbox
from gapless.sandbox.probes import QUICK, Probe, all_failed


def run_harness(sandbox: BwrapSandbox, probe: Probe) -> tuple[str, str]:
    problem = CodeProblem(uid="probe", level=1, prompt="def f(x):\n    return ", solution="x + 1", overfit_solution="abs(x) + 1",
                          entry_point="f", test_inputs=("[1]", "[2]"), test_outputs=("2", "3"))  # fmt: skip
    env = CodeEnvironment(sandbox, probe.limits, concurrency=1)
    try:
        _, status, info = env.score_text(problem, probe.code)
    finally:
        env.pool.shutdown(wait=True)  # not env.close(): the sandbox is the caller's
    return status, str(info.get("stdout_tail", ""))


def _harness(name: str, completion: str, *expect: str, check=lambda stdout: True) -> Probe:
    return Probe(name, completion, frozenset(expect), QUICK, check, runner=run_harness)


HARNESS_PROBES: tuple[Probe, ...] = (
    _harness("exit(0) before the tests run", "0\nimport sys\nsys.exit(0)", "harness_incomplete"),
    _harness("os._exit(0) before the tests run", "0\nimport os\nos._exit(0)", "harness_incomplete"),
    _harness(
        "edit the test file",
        """0
for path in ("/work/job/judge/tests.json", "/work/job/tests.json", "/work/job/harness.py"):
    try:
        open(path, "w").write("[]")
        print(path, "REACHED")
    except OSError as error:
        print(path, type(error).__name__)""",
        "wrong_answer",
        check=all_failed,
    ),
    _harness(
        "fake results on the report fd",
        """0
import os
for i in range(2):
    os.write(3, ('{"i": %d, "out": 999}\\n' % i).encode())
os._exit(0)""",
        "harness_incomplete",
        "wrong_answer",
    ),
)
