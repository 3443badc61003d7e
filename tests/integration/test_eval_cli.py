"""`gapless eval` end to end: a locally saved tiny checkpoint on HumanEval, through the CLI."""

import json
import shutil

import pytest

from gapless.cli import main
from gapless.config import ModelConfig
from gapless.envs.code.dataset import humaneval_tasks
from gapless.models import build_tiny

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    texts = [t.prompt + t.solution for t in humaneval_tasks()["eval"]]
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    build_tiny(cfg, texts, seed=0).save(path)
    return path


@pytest.mark.parametrize("samples", [1, 3])
def test_eval_humaneval_writes_pass_at_1(checkpoint, tmp_path, capsys, samples):
    run_dir = tmp_path / "eval"
    code = main(
        [
            "eval",
            "--task.name",
            "humaneval",
            "--model.path",
            str(checkpoint),
            "--run-dir",
            str(run_dir),
            "--generator.max_new_tokens",
            "16",
            "--eval.max_tasks",
            "6",
            "--eval.samples",
            str(samples),
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    result = json.loads((run_dir / "eval.json").read_text())
    assert printed["pass@1"] == result["pass@1"] and 0.0 <= result["pass@1"] <= 1.0
    assert result["task"] == "humaneval" and result["num_tasks"] == 6 and result["samples"] == samples
    assert result["greedy"] == (samples == 1) and f"pass@{samples}" in result
    assert sum(result["statuses"].values()) == 6 * samples
    assert [r["uid"] for r in result["per_task"]] == [f"HumanEval/{i}" for i in range(6)]


def test_eval_rejects_training_flags(capsys):
    assert main(["eval", "--resume"]) == 2
    assert "--resume is for gapless train" in capsys.readouterr().err
