"""The code environment: untrusted completions become a reward and a status, never an exception."""

import shutil

import pytest

from gapless.envs.code.environment import CodeEnvironment, SandboxUnavailable, parse_report
from gapless.envs.code.problems import generate_problems
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
LIMITS = SandboxLimits(timeout_s=3.0)


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(BwrapSandbox(LIMITS), LIMITS, concurrency=4)
    yield environment
    environment.close()


@pytest.fixture(scope="module")
def int_problem():
    return next(
        p for p in generate_problems(0, "train", 50, [2]) if p.solution.startswith(" x * ") and "+" in p.solution
    )


@pytest.mark.parametrize(
    "completion, status, reward",
    [
        ("{solution}", "ok", 1.0),
        ("{overfit}", "wrong_answer", None),  # right on visible examples, wrong on some hidden ones
        (" 0", "wrong_answer", 0.0),
        (" x +* 2", "compile_error", 0.0),
        (" 1/0", "wrong_answer", 0.0),  # raises on every test: each test fails
        (" exit(0)", "wrong_answer", 0.0),  # SystemExit in a call: that call's failure, in its own process
        (" __import__('os')._exit(0)", "harness_incomplete", 0.0),
        (" 0\nimport sys; sys.exit(0)", "harness_incomplete", 0.0),  # module-level exit before the tests run
        (' 0\nprint(\'{{"i": 0, "out": 1}}\')', "wrong_answer", 0.0),  # fake results on stdout count for nothing
        (
            ' 0\nimport os; os.write(3, b\'{{"i": 0, "out": 123456}}\\n\')',
            "harness_incomplete",
            0.0,
        ),  # fd 3 is the channel to the judge: not ready
        (" 0\nbomb = [0] * 10**10", "memory_limit", 0.0),  # allocated at import: the program dies of it
        (" __import__('time').sleep(60)", "timeout", 0.0),
    ],
)
def test_statuses_and_rewards(env, int_problem, completion, status, reward):
    text = completion.format(solution=int_problem.solution, overfit=int_problem.overfit_solution)
    got_reward, got_status, _ = env.score_text(int_problem, text)
    assert got_status == status
    if reward is not None:
        assert got_reward == reward
    else:
        assert 0.0 <= got_reward < 1.0


def test_every_reference_solution_passes(env):
    problems = generate_problems(3, "eval", 30, [1, 2, 3])
    results = [env.score_text(p, p.solution) for p in problems]
    assert all(status == "ok" and reward == 1.0 for reward, status, _ in results)


def test_group_scoring_dedupes_and_keeps_order(env, int_problem):
    def completion(text):
        return Completion([1], [2], [-0.1], [0], "stop", text)

    texts = [int_problem.solution, " 0", int_problem.solution, " 0"]
    rollouts = env.score(int_problem, [completion(t) for t in texts])
    assert [r.status for r in rollouts] == ["ok", "wrong_answer", "ok", "wrong_answer"]
    assert [r.completion.text for r in rollouts] == texts


def test_broken_sandbox_is_infra_error_never_a_reward(int_problem):
    broken = CodeEnvironment(BwrapSandbox(LIMITS, python="/nonexistent/python3"), LIMITS, concurrency=2)
    try:
        reward, status, info = broken.score_text(int_problem, int_problem.solution)
        assert status == "infra_error" and "error" in info
        completion = Completion([1], [2], [-0.1], [0], "stop", int_problem.solution)
        rollouts = broken.score(int_problem, [completion, completion])
        assert all(r.is_infra_failure for r in rollouts)
        with pytest.raises(SandboxUnavailable, match="gapless sandbox"):
            broken.check_infra(rollouts)
    finally:
        broken.close()


def test_report_parser_counts_garbage_and_ignores_duplicates():
    expected = ("1", "2")
    report = b'garbage\n{"i": 0, "out": 1}\n{"i": 0, "out": 5}\n[1]\n{"i": 7, "out": 2}\n\xff\n'
    passed, complete, compile_error, malformed = parse_report(report, expected)
    assert (passed, complete, compile_error, malformed) == (1, False, None, 3)  # garbage, [1], \xff


def _assert_task(tests):
    from gapless.envs.code.dataset import parse_code_record

    return parse_code_record({"prompt": "def pair(a, b):\n", "entry_point": "pair", "tests": tests})


def test_literal_asserts_are_compared_on_the_host_with_the_asserts_meaning(env):
    from gapless.envs.code.asserts import host_compared

    tests = ["assert pair(1, 2) == (1, 2)", "assert (2, 1) == candidate(2, 1)", "assert pair(0, 0.0) == (0, 0)"]
    task = _assert_task(tests)
    assert host_compared(task.entry_point, task.test_inputs) is not None
    assert host_compared(task.entry_point, _assert_task([*tests, "assert pair(1, 1)"]).test_inputs) is None
    cases = {
        "    return (a, b)": ("ok", 1.0),  # `(0, 0.0) == (0, 0)` holds, as in the assert
        "    return [a, b]": ("wrong_answer", 0.0),  # a list is not a tuple
        "    class Any(tuple):\n        def __eq__(self, other):\n            return True\n    return Any((9,))": (
            "wrong_answer",
            0.0,
        ),  # a tuple subclass crosses as the plain tuple it holds
        "    return a +": ("compile_error", 0.0),
        "    import os\n    os._exit(0)": ("harness_incomplete", 0.0),
    }
    for text, (status, reward) in cases.items():
        got_reward, got_status, _ = env.score_text(task, text)
        assert (got_status, got_reward) == (status, reward), text


def test_asserts_that_are_not_literal_comparisons_still_run_in_the_judge(env):
    task = _assert_task(["assert pair(1, 2)[0] == 1", "x = pair(3, 4)\nassert x == (3, 4)"])
    assert env.score_text(task, "    return (a, b)")[:2] == (1.0, "ok")
    assert env.score_text(task, "    return (b, a)")[:2] == (0.0, "wrong_answer")
