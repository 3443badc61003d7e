"""`gapless train --model.path DIR --loop.steps 2` on tiny random checkpoints of every family the
engine serves, built here (transformers config -> save_pretrained, with a tokenizer beside it),
synchronous and at staleness budget 1: no crash, two trained steps, and the engine path that
the run logged and recorded is the one `families` names for that model type.
The 16 command-line runs are slow (each starts the actor processes: about a minute here); the
fast suite runs the in-process synchronous loop on a generic-path family (gemma2)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gapless.config import ModelConfig
from gapless.envs.code.problems import generate_problems
from gapless.models import build_tiny

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
ROOT = Path(__file__).parents[2]
PATHS = {
    "llama": "lean",
    "qwen2": "lean",
    "qwen3": "lean",
    "mistral": "lean",
    "phi3": "lean",
    "olmo2": "lean",
    "gemma2": "generic",
    "gemma3": "generic",
}


def _checkpoint(family: str, directory: Path) -> Path:
    cfg = ModelConfig(
        architecture=family,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        vocab_size=300,
    )
    problems = generate_problems(0, "train", 64, [1])
    policy = build_tiny(cfg, [p.prompt + p.solution for p in problems], seed=0)
    policy.model.save_pretrained(directory)  # a plain HF checkpoint, as a user would bring one
    policy.tokenizer.save_pretrained(directory)
    return directory


def _overrides(model_dir: Path, run_dir: Path, budget: int) -> dict[str, str]:
    return {
        "model.path": json.dumps(str(model_dir)),
        "run_dir": json.dumps(str(run_dir)),
        "loop.steps": "2",
        "warmstart.steps": "0",
        "pipeline.max_staleness": str(budget),
        "task.num_eval_prompts": "2",
    }


@pytest.mark.parametrize("family", ["gemma2"])
def test_sync_loop_two_steps(family, tmp_path):
    from gapless.config import load_config
    from gapless.orchestrate.loop import RunLoop

    cfg = load_config(
        ROOT / "configs" / "smoke.toml", _overrides(_checkpoint(family, tmp_path / "model"), tmp_path / "run", 0)
    )
    lines: list[str] = []
    summary = RunLoop(cfg, log=lines.append, source="inline").run()
    assert summary["steps"] == 2 and summary["trained_samples"] == 16
    assert json.loads((tmp_path / "run" / "generator.json").read_text())["path"] == PATHS[family]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 1])
@pytest.mark.parametrize("family", list(PATHS))
def test_train_two_steps(family, budget, tmp_path):
    model_dir = _checkpoint(family, tmp_path / "model")
    run_dir = tmp_path / "run"
    args = [a for k, v in _overrides(model_dir, run_dir, budget).items() for a in (f"--{k}", v)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "gapless.cli", "train", str(ROOT / "configs" / "smoke.toml"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    record = json.loads((run_dir / "generator.json").read_text())
    model_type = "gemma3_text" if family == "gemma3" else family
    assert (record["path"], record["model_type"]) == (PATHS[family], model_type)
    assert record["notice"] in proc.stdout.splitlines()
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "train/loss" in line
    ]
    assert steps == [1, 2]
