"""The documented example environment (examples/reverse_env.py) runs through real loop steps."""

import importlib.util
import json
from pathlib import Path

from gapless.config import load_config
from gapless.envs.base import Environment, Teacher
from gapless.orchestrate.loop import RunLoop

ROOT = Path(__file__).parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("reverse_env", ROOT / "examples" / "reverse_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReverseEnvironment()


def test_example_environment_trains_for_a_few_steps(tmp_path, warm_cache):
    env = _example()
    assert isinstance(env, Environment) and isinstance(env, Teacher)
    assert len((ROOT / "examples" / "reverse_env.py").read_text().splitlines()) < 60  # docstring and runner included
    cfg = load_config(
        ROOT / "configs" / "smoke.toml",
        {
            "run_dir": json.dumps(str(tmp_path / "run")),
            "loop.steps": "3",
            "warmstart.cache_dir": json.dumps(str(warm_cache)),
        },
    )
    summary = RunLoop(cfg, log=lambda *_: None, env=env, source="inline").run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "rollout/reward_mean" in line]
    assert len(steps) == 3 and summary["steps"] == 3
    assert (
        sum(
            line.get("rollout/status_ok", 0)
            + line.get("rollout/status_wrong_answer", 0)
            + line.get("rollout/status_no_answer", 0)
            for line in steps
        )
        == 3 * 2 * 4
    )  # every rollout has a status
