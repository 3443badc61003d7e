"""The swe environment over a real (tiny) repository in a real sandbox: the grader against an
independent re-implementation of SWE-bench's pass rule (reference 1, unfixed 0, one test left
failing 0), the tools sized for real code, the hidden test out of the agent's view, and a scripted
agent that applies the reference patch through the tools scoring 1 through the full episode path."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sandbox_host import IS_ROOT, needs_bwrap
from swe_instance import (  # noqa: F401
    FAIL_TO_PASS,
    PASS_TO_PASS,
    instance,
    instance_file,
    swe_env_dir,
    swe_environment,
    swebench_resolved,
)

from gapless.envs.swe.environment import SweEnvironment, split_instances
from gapless.envs.swe.grading import Changes, GradeRules, grading_tree, with_patch
from gapless.envs.swe.testrun import DEFAULT_LIMITS, load_env, run_tests
from gapless.envs.swe.tools import prompt_of
from gapless.sandbox import SandboxLimits
from gapless.types import Completion

pytestmark = [needs_bwrap, pytest.mark.skipif(not IS_ROOT, reason="copy-on-write sessions need root")]
LIMITS = SandboxLimits(timeout_s=30.0, memory_mb=1024, max_processes=32, tmp_size_mb=16, max_output_bytes=8 << 20)
GRADE_LIMITS = replace(DEFAULT_LIMITS, timeout_s=60.0, memory_mb=1024, tmp_size_mb=64)


@pytest.fixture(scope="module")
def env(instance):  # noqa: F811
    with swe_environment(instance, LIMITS, GRADE_LIMITS) as environment:
        yield environment


def test_the_grader_agrees_with_swebench_rule(env, instance):  # noqa: F811
    snapshot = env.snapshots.get(instance).files
    fixed = with_patch(snapshot, instance.patch)
    broken_other = dict(fixed)
    broken_other["tinystats/core.py"] = fixed["tinystats/core.py"].replace(b"return low\n", b"return high\n")
    cases = {
        "reference": (Changes({"tinystats/core.py": fixed["tinystats/core.py"]}), 1.0),
        "unfixed": (Changes({}), 0.0),
        "one test left failing": (Changes({"tinystats/core.py": broken_other["tinystats/core.py"]}), 0.0),
    }
    env_files = load_env(instance.env_path)
    for name, (changes, expected) in cases.items():
        graded = env.grade(instance, changes)
        tree, hooks, _ = grading_tree(instance, snapshot, changes, GradeRules())
        run = run_tests(env.sandbox, tree, FAIL_TO_PASS + PASS_TO_PASS, env_files, GRADE_LIMITS, hook_files=hooks)
        rule = swebench_resolved(run.outcomes, FAIL_TO_PASS, PASS_TO_PASS)
        assert (graded.reward, float(rule)) == (expected, expected), (name, graded, run.outcomes)
        assert graded.status == ("ok" if expected else "tests_failed")
    partial = SweEnvironment.grade(
        replace_rules(env, GradeRules(partial_credit=True)), instance, cases["one test left failing"][0]
    )
    assert partial.reward == 0.0 and partial.info["p2p_failed"] == ["tests/test_core.py::test_clamp_low"]


def replace_rules(env, rules):
    clone = object.__new__(SweEnvironment)
    clone.__dict__.update(env.__dict__, rules=rules)
    return clone


def episode(env, turns: list[str]):
    """Drive one episode through the environment's own turn path with scripted model turns."""
    task = env.tasks("train")[0]
    ep = env.start_episode(task, [1, 2, 3])
    for text in turns:
        if ep.is_done:
            break
        env.take_turn(ep, Completion([1, 2, 3], [7], [-0.1], [0], "stop", text), lambda s: [5] * min(len(s), 3))
    return ep, env.to_rollout(ep)


def test_a_scripted_agent_applying_the_reference_scores_one(env):
    task = env.tasks("train")[0]
    script = [text for text, is_model in env.demonstration_turns(task, random.Random(0)) if is_model]
    assert any("<cmd>patch" in s for s in script) and script[-1] == "<cmd>done</cmd>"
    ep, rollout = episode(env, script)
    assert (rollout.reward, rollout.status) == (1.0, "ok"), rollout.info
    assert rollout.info["ended_by"] == "done" and rollout.info["changed_files"] == 1
    outputs = [t for t in ep.texts if t.startswith("<out>")]
    assert outputs[0].startswith("<out>    ") and "return sum(values) / (len(values) + 1)" in outputs[0]
    assert outputs[1] == "<out>patched</out>\n"


def test_the_unfixed_repository_scores_zero_through_the_episode(env):
    _, rollout = episode(env, ["<cmd>ls</cmd>", "<cmd>done</cmd>"])
    assert (rollout.reward, rollout.status) == (0.0, "tests_failed")
    assert rollout.info["f2p_failed"] == FAIL_TO_PASS and rollout.info["changed_files"] == 0


def test_tools_for_real_code(env):
    ep, rollout = episode(
        env,
        [
            "<cmd>ls tinystats</cmd>",
            "<cmd>cat tinystats/core.py 4-6</cmd>",
            "<cmd>grep def (mean|clamp)\ntinystats</cmd>",
            "<cmd>grep test_mean\\b</cmd>",
            "<cmd>test tests/test_core.py</cmd>",
            "<cmd>run python -c 'import pytest, tinystats; print(tinystats.mean([2, 4]))'</cmd>",
            "<cmd>cat tinystats/nope.py</cmd>",
            "<cmd>cat ../etc/passwd</cmd>",
            "<cmd>done</cmd>",
        ],
    )
    out = [t for t in ep.texts if t.startswith("<out>")]
    assert out[0] == "<out>tinystats/__init__.py\ntinystats/core.py\ntinystats/text.py</out>\n"
    assert out[1] == (
        '<out>    4 def mean(values):\n    5     if not values:\n    6         raise ValueError("mean of an empty'
        ' sequence")\n[lines 4-6 of 36]</out>\n'
    )
    assert (
        out[2]
        == "<out>tinystats/core.py:4: def mean(values):\ntinystats/core.py:10: def clamp(value, low, high):</out>\n"
    )
    assert out[3] == "<out>no match</out>\n"  # the hidden test is not in the session
    assert "passed" in out[4] and "[exit 0]" in out[4]
    assert out[5] == "<out>2.0\n[exit 0]</out>\n"  # the bug: 6 / 3
    assert "No such file" in out[6] and "outside the repository" in out[7]
    assert rollout.status == "tests_failed"


def test_output_is_cut_to_the_budget(env):
    small = replace_rules(env, env.rules)
    small.sizes = replace(env.sizes, max_output_bytes=64)
    ep, _ = episode(small, ["<cmd>run python -c 'print(\"x\" * 5000)'</cmd>", "<cmd>done</cmd>"])
    shown = ep.texts[1]
    assert len(shown.encode()) <= 64 + len("<out></out>\n") and "..." in shown


def test_split_and_prompt(instance):  # noqa: F811
    many = [replace(instance, instance_id=f"i{n}") for n in range(20)]
    parts = split_instances(many, 0.1)
    assert len(parts["eval"]) == 2 and len(parts["train"]) == 18
    assert not {i.instance_id for i in parts["eval"]} & {i.instance_id for i in parts["train"]}
    assert split_instances([instance], 0.1) == {"train": [instance], "eval": [instance]}
    assert "mean()" in prompt_of(instance) and "<cmd>" in prompt_of(instance)
