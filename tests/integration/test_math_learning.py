"""Reward must go up on the math task: a short real RL run (tiny model, real math-verify).

The warm start's teacher evaluates left to right half of the time (3+4*2 -> 14), so the
warm-started model gives both answers to the level-3 prompts; GRPO against the verifier has to
find out which one is rewarded.
"""

import json
from pathlib import Path

from gapless.config import load_config
from gapless.orchestrate.loop import RunLoop

CONFIGS = Path(__file__).parents[2] / "configs"


def test_math_reward_rises_on_repeated_prompts(tmp_path, warm_cache):
    overrides = {
        "run_dir": json.dumps(str(tmp_path / "run")),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "task.name": '"math"',
        "task.levels": "[3]",
        "task.num_train_prompts": "4",
        "generator.group_size": "8",
        "generator.max_new_tokens": "4",
        "loop.prompts_per_step": "4",
        "loop.steps": "16",
        "loop.eval_every": "100",
        "loop.checkpoint_every": "100",
        "trainer.lr": "3e-3",
    }
    loop = RunLoop(load_config(CONFIGS / "smoke.toml", overrides), log=lambda *_: None, source="inline")
    loop.run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [line["rollout/reward_mean"] for line in lines if "rollout/reward_mean" in line]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print("math rollout/reward_mean by step:", [round(r, 2) for r in rewards])
    assert last > first + 0.15, rewards
