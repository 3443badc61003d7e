"""Every instance of the default SWE task set (scripts/setup.sh builds it; skipped where it is not
built): the reference patch scores 1 and the unfixed snapshot 0 through the environment's grader,
and a scripted agent that applies the reference patch through the tools scores 1 through the full
episode path on a sample. GAPLESS_SWE_SET names another built set; GAPLESS_TEST_UID_BASE the
sandbox's slot uids (default 200000)."""

from __future__ import annotations

import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from gapless.envs.swe.default_set import default_instances_path
from gapless.envs.swe.environment import SweEnvironment
from gapless.envs.swe.grading import Changes, with_patch
from gapless.envs.swe.instances import load_instances
from gapless.envs.swe.testrun import DEFAULT_LIMITS
from gapless.envs.swe.tools import SweTask, prompt_of
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion

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


def test_reference_scores_one_and_unfixed_zero_on_every_instance(env):
    def both(task):
        instance = task.instance
        files = env.snapshots.get(instance).files
        fixed = with_patch(files, instance.patch)
        changes = Changes(
            {p: d for p, d in fixed.items() if files.get(p) != d}, tuple(p for p in files if p not in fixed)
        )
        return instance.instance_id, env.grade(instance, changes), env.grade(instance, Changes({}))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(both, env.tasks("train")))
    wrong = [(i, r.reward, r.info, u.reward, u.info) for i, r, u in results if (r.reward, u.reward) != (1.0, 0.0)]
    print(f"{len(results)} instances: reference 1 and unfixed 0 on {len(results) - len(wrong)}")
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
