"""Every instance of the default SWE task set (scripts/setup.sh builds it; skipped where it is not
built): the reference patch scores 1 and the unfixed snapshot 0 through the environment's grader,
and a scripted agent that applies the reference patch through the tools scores 1 through the full
episode path on a sample. GAPLESS_SWE_SET names another built set; GAPLESS_TEST_UID_BASE the
sandbox's slot uids (default 200000)."""

from __future__ import annotations

import os
import random
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from gapless.envs.swe.default_set import default_instances_path
from gapless.envs.swe.environment import SweEnvironment
from gapless.envs.swe.grading import Changes, GradeRules, grading_tree, resolution, with_patch
from gapless.envs.swe.instances import load_instances
from gapless.envs.swe.testrun import DEFAULT_LIMITS, Outcome, load_env, run_tests
from gapless.envs.swe.tools import SweTask, prompt_of
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from swe_instance import swebench_resolved  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="copy-on-write sessions need root"),
    pytest.mark.skipif(not default_instances_path().is_file(), reason="the default SWE set is not built"),
]
LIMITS = SandboxLimits(timeout_s=120.0, memory_mb=1024, max_processes=32, tmp_size_mb=32, max_output_bytes=8 << 20)
SAMPLE = 6  # instances driven through whole episodes


@pytest.fixture(scope="module")
def env():
    instances = load_instances(default_instances_path())
    tasks = [SweTask(i.instance_id, prompt_of(i), i) for i in instances]
    sandbox = BwrapSandbox(
        LIMITS, slot_uid_base=int(os.environ.get("GAPLESS_TEST_UID_BASE", "200000")), max_concurrency=4
    )
    environment = SweEnvironment(
        sandbox, {"train": tasks, "eval": tasks}, LIMITS, DEFAULT_LIMITS, max_turns=64, sessions=4
    )
    try:
        yield environment
    finally:
        environment.close()


def test_the_grader_agrees_with_swebench_rule_on_every_instance(env):
    """Reference 1, unfixed 0, and the reference run with one FAIL_TO_PASS test turned failed 0,
    by the grader's rule and by the re-implementation of SWE-bench's (swe_instance.py)."""

    def rules(task):
        instance = task.instance
        files = env.snapshots.get(instance).files
        fixed = with_patch(files, instance.patch)
        reference = Changes(
            {p: d for p, d in fixed.items() if files.get(p) != d}, tuple(p for p in files if p not in fixed)
        )
        ids = list(dict.fromkeys((*instance.fail_to_pass, *instance.pass_to_pass)))
        env_files = load_env(instance.env_path) if instance.env_path else None
        out = []
        for changes in (reference, Changes({})):
            tree, hooks, _ = grading_tree(instance, files, changes, GradeRules())
            run = run_tests(env.sandbox, tree, ids, env_files, DEFAULT_LIMITS, instance.test_command, hooks)
            out.append(run)
        one_left = replace(out[0], outcomes={**out[0].outcomes, instance.fail_to_pass[0]: Outcome.FAILED})
        verdicts = [
            (
                resolution(run, instance, GradeRules())[0],
                float(swebench_resolved(run.outcomes, instance.fail_to_pass, instance.pass_to_pass)),
            )
            for run in (*out, one_left)
        ]
        return instance.instance_id, verdicts

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(rules, env.tasks("train")))
    expected = [(1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]
    wrong = [(i, v) for i, v in results if v != expected]
    print(
        f"{len(results)} instances: grader == SWE-bench's rule, reference 1, unfixed 0, one left failing 0 on {len(results) - len(wrong)}"
    )
    assert not wrong, wrong[:3]


def test_a_scripted_agent_applying_the_reference_scores_one(env):
    for task in random.Random(0).sample(list(env.tasks("train")), SAMPLE):
        script = [text for text, is_model in env.demonstration_turns(task, random.Random(0)) if is_model]
        ep = env.start_episode(task, [1])
        for text in script:
            if ep.is_done:
                break
            env.take_turn(ep, Completion([1], [7], [-0.1], [0], "stop", text), lambda s: [5])
        rollout = env.to_rollout(ep)
        assert (rollout.reward, rollout.status) == (1.0, "ok"), (task.uid, rollout.info)
