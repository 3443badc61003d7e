"""Reward must go up: a short real RL run (tiny model, real sandbox) on a few prompts."""

import json
import shutil
from pathlib import Path

import pytest

from gapless.config import load_config
from gapless.orchestrate.loop import RunLoop

CONFIGS = Path(__file__).parents[2] / "configs"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def test_reward_rises_on_repeated_prompts(tmp_path, warm_cache):
    overrides = {
        "run_dir": json.dumps(str(tmp_path / "run")),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "task.num_train_prompts": "4",
        "generator.group_size": "8",
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
    assert last > first + 0.15, rewards
