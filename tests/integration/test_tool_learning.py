"""Reward must go up on the multi-turn tool task: a tiny model, warm-started on an imperfect
teacher's transcripts, then a short real RL run through the sync loop (real sandbox sessions,
masked tool output) on a few repeated prompts.

The measurement holds on any machine: the policy before and after RL is scored on the same 4
prompts x 64 sampled episodes (fixed seeds), and the gain must exceed three standard errors of
its own sampling noise. The figure it guards, measured over 8 seeds at 12 RL steps: gains 0.10 to
0.62 (2.6 to 16 standard errors); at the 20 steps used here the weakest seeds gain 0.17 (4.2 s.e.)
and 0.32. A different CPU or thread count changes the float rounding and so the trajectory, like
a new seed; the margin is sized for the weakest seed, not for seed 0. The workload (model,
prompts, teacher, warm start) is bench/agentic.py's TOOL_LEARNING, imported so the two cannot drift.
"""

import json
import math
import shutil

import pytest
from benches import load_bench

from gapless.config import load_config
from gapless.envs.registry import make_environment
from gapless.orchestrate.loop import RunLoop
from gapless.types import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
SAMPLES = 64


def _mean_reward(loop: RunLoop, env) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=loop.cfg.generator.max_new_tokens, seed=12345)
    groups = env.rollout_groups(loop.sampler, loop.train, SAMPLES, params, loop.policy.encode)
    rewards = [r.reward for group in groups for r in group]
    return sum(rewards) / len(rewards), len(rewards)


def test_tool_use_reward_rises(tmp_path, warm_cache):
    overrides = {
        "run_dir": json.dumps(str(tmp_path / "run")),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        **load_bench("agentic").TOOL_LEARNING,
        "loop.steps": "20", "loop.eval_every": "100", "loop.checkpoint_every": "100", "trainer.threads": "1",
    }  # fmt: skip
    loop = RunLoop(load_config(None, overrides), log=lambda *_: None, source="inline")
    before, n = _mean_reward(loop, loop.env)
    loop.run()  # closes its environment at the end
    env = make_environment(loop.cfg)
    try:
        after, _ = _mean_reward(loop, env)
    finally:
        env.close()
    stderr = math.sqrt(before * (1 - before) / n + after * (1 - after) / n)
    assert after - before > 3 * stderr, (before, after, stderr)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lengths = [line["rollout/completion_len_mean"] for line in lines if "rollout/completion_len_mean" in line]
    assert min(lengths[-3:]) > 14, lengths  # the reward comes through the tool (a direct answer is ~7 tokens)
    assert all(line.get("staleness/max", 0.0) == 0.0 for line in lines)
