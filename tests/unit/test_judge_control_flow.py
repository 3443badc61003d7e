"""The judge runs the test's control flow, never the candidate's (envs/code/sandbox_scripts/judge.py).

An asserts task (the judge runs each `check(candidate)`) whose tests call the entry point through
the shapes that give an exception a meaning of its own: `map`, `zip`, `filter`, `next` with a
default, `iter(callable, sentinel)`, a sort key, a generator, `getattr` with a default over a
property, `contextlib.suppress`, a callback whose exception the test catches. The correct
completion passes every shape; a completion that raises, whatever it raises (StopIteration,
GeneratorExit, KeyboardInterrupt, SystemExit, a BaseException of its own ...), fails every one.
Real sandbox runs: one per draw, all the drawn shapes as the task's tests.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.envs.code.environment import CodeEnvironment
from gapless.envs.code.problems import CodeProblem
from gapless.sandbox import BwrapSandbox, SandboxLimits

pytestmark = needs_bwrap
LIMITS = SandboxLimits(timeout_s=5.0)
SHAPES = {  # each passes for f(x) = x + 1, and passed for a StopIteration-raising f before the flag
    "map": "assert all(map(lambda x: candidate(x) == x + 1, [1, 2, 3]))",
    "zip": "assert all(a == b for a, b in zip(map(candidate, [1, 2, 3]), [2, 3, 4]))",
    "filter": "assert list(filter(lambda x: candidate(x) != x + 1, [1, 2, 3])) == []",
    "next with a default": "assert next(map(candidate, [3]), 4) == 4",
    "iter(callable, sentinel)": "assert list(iter(lambda: candidate(3), 4)) == []",
    "sort key": "assert sorted([3, 1, 2], key=candidate) == [1, 2, 3]",
    "generator": "def results():\n        for x in [1, 2]:\n            yield candidate(x)\n    assert list(results()) == [2, 3]",
    "getattr over a property": ("class Box:\n        @property\n        def value(self):\n            return candidate(3)\n"
                                "    assert getattr(Box(), 'value', 4) == 4"),
    "contextlib.suppress": "import contextlib\n    with contextlib.suppress(BaseException):\n        assert candidate(3) == 4",
    "callback caught by the test": ("def call(function, x):\n        try:\n            return function(x)\n"
                                    "        except BaseException:\n            return x + 1\n    assert call(candidate, 3) == 4"),
}  # fmt: skip
RAISED = [
    "StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit", "BaseException",
    "Exception", "ValueError", "AttributeError", "IndexError", "KeyError", "RecursionError", "Boom", "Quiet",
]  # fmt: skip
OWN_EXCEPTIONS = "class Boom(BaseException):\n    pass\n\n\nclass Quiet(StopIteration):\n    pass\n"


def task(shapes: list[str]) -> CodeProblem:
    tests = tuple(json.dumps(f"def check(candidate):\n    {SHAPES[name]}\n") for name in shapes)
    return CodeProblem(uid="shapes", level=1, prompt='def f(x):\n    """x + 1"""\n', solution="    return x + 1\n",
                       overfit_solution="", entry_point="f", test_inputs=tests, test_outputs=("true",) * len(tests),
                       harness="asserts")  # fmt: skip


def raising(name: str) -> str:
    return f"    raise {name}\n\n\n{OWN_EXCEPTIONS}"


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE + 20, max_concurrency=2), LIMITS,
                                  concurrency=2)  # fmt: skip
    yield environment
    environment.close()


def test_the_correct_completion_passes_every_shape(env):
    problem = task(list(SHAPES))
    assert env.score_text(problem, problem.solution)[:2] == (1.0, "ok")


@pytest.mark.parametrize("raised", RAISED)
def test_a_candidate_that_raises_fails_every_shape(env, raised):
    reward, status, info = env.score_text(task(list(SHAPES)), raising(raised))
    assert (reward, status, info["passed"]) == (0.0, "wrong_answer", 0), info


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raised=st.sampled_from(RAISED), shapes=st.lists(st.sampled_from(list(SHAPES)), min_size=1, max_size=4),
       on_call=st.integers(min_value=1, max_value=3))  # fmt: skip
def test_an_exception_on_any_call_fails_the_test_that_made_it(env, raised, shapes, on_call):
    """The candidate answers right until its `on_call`-th call, then raises: every test that
    reached that call fails, whatever its shape did with the exception; the others pass."""
    completion = ("    global CALLS\n    CALLS += 1\n"
                  f"    if CALLS == {on_call}:\n        raise {raised}\n    return x + 1\n\n\nCALLS = 0\n{OWN_EXCEPTIONS}")  # fmt: skip
    reward, status, info = env.score_text(task(shapes), completion)
    calls = [_calls(name) for name in shapes]  # calls each test makes of a correct candidate
    failing = sum(1 for before, made in zip(_running_sum(calls), calls) if before < on_call <= before + made)
    assert info["passed"] == len(shapes) - failing, (raised, shapes, on_call, info)
    assert status == ("ok" if failing == 0 else "wrong_answer"), info


def _calls(shape: str) -> int:
    """How many times the shape calls a correct candidate."""
    return {"map": 3, "zip": 3, "filter": 3, "sort key": 3, "generator": 2}.get(shape, 1)


def _running_sum(counts: list[int]) -> list[int]:
    sums, total = [], 0
    for count in counts:
        sums.append(total)
        total += count
    return sums
