"""A few real steps of the whole loop: tiny model, real sandbox, real GRPO updates."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gapless.config import Config, load_config
from gapless.orchestrate.loop import RunLoop, train

CONFIGS = Path(__file__).parents[2] / "configs"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def smoke(tmp_path: Path, cache: Path | None = None, **overrides: str):
    return load_config(
        CONFIGS / "smoke.toml",
        {
            "run_dir": json.dumps(str(tmp_path / "run")),
            "warmstart.cache_dir": json.dumps(str(cache or tmp_path / "cache")),
            **overrides,
        },
    )


def test_default_toml_is_the_embedded_default():
    assert load_config(CONFIGS / "default.toml") == Config()


def test_few_steps_change_parameters_and_write_metrics(tmp_path, warm_cache):
    cfg = smoke(tmp_path, warm_cache)
    loop = RunLoop(cfg, log=lambda *_: None, source="inline")
    before = {k: v.clone() for k, v in loop.policy.model.state_dict().items()}
    summary = loop.run()
    after = loop.policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    # the generator serves the trainer's weights after every push
    for k, v in loop.sampler.state_dict().items():
        assert torch.equal(v, after[k])
    assert loop.sampler.version == loop.trainer.version == cfg.loop.steps

    run = Path(cfg.run_dir)
    assert json.loads((run / "config.json").read_text())["loop"]["steps"] == 3
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "rollout/reward_mean" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    for key in ("rollout/reward_mean", "train/loss", "perf/step_s", "perf/gen_tokens_per_s", "staleness/max"):
        assert all(key in line for line in steps), key
    assert all(line["staleness/max"] == 0 for line in steps)
    assert "eval/pass@1" in lines[0] and "eval/pass@1" in lines[-1]
    for key in ("eval/pass@1_start", "eval/pass@1_end", "wall_s", "trained_samples"):
        assert key in summary
    assert summary["trained_samples"] == 3 * 2 * 4
    assert json.loads((run / "summary.json").read_text()) == summary


def test_checkpoint_is_loadable_and_resume_continues(tmp_path, warm_cache):
    cfg = smoke(tmp_path, warm_cache, **{"loop.steps": "2"})
    train(cfg, log=lambda *_: None)
    ckpt = Path(cfg.run_dir) / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # plain HF format
    assert sum(p.numel() for p in model.parameters()) > 0

    longer = smoke(tmp_path, warm_cache, **{"loop.steps": "4"})
    loop = RunLoop(longer, resume=True, log=lambda *_: None, source="inline")
    assert loop.start_step == 2 and loop.trainer.version == 2
    assert torch.equal(next(iter(loop.policy.model.state_dict().values())), next(iter(model.state_dict().values())))
    summary = loop.run()
    assert summary["trained_samples"] == 4 * 2 * 4
    steps = [
        json.loads(line)["step"]
        for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
        if "train/loss" in line
    ]
    assert steps == [1, 2, 3, 4]


def test_warm_start_is_cached_and_deterministic(tmp_path):
    cfg = smoke(tmp_path)
    first = RunLoop(cfg, log=lambda *_: None, source="inline")
    second = RunLoop(cfg, log=lambda *_: None, source="inline")
    assert first.setup_info["warmstart_cached"] is False and second.setup_info["warmstart_cached"] is True
    for (k, a), b in zip(first.policy.model.state_dict().items(), second.policy.model.state_dict().values()):
        assert torch.equal(a, b), k
    first.env.close(), second.env.close()


def test_killed_run_leaves_a_loadable_checkpoint_and_resumes(tmp_path, warm_cache):
    import signal
    import subprocess
    import sys
    import time

    from gapless.trainer.checkpoint import latest_checkpoint

    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "gapless.cli",
        "train",
        str(CONFIGS / "smoke.toml"),
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        json.dumps(str(warm_cache)),
        "--loop.steps",
        "200",
        "--loop.checkpoint_every",
        "1",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(run) is None or latest_checkpoint(run).name == "step_1":
            assert proc.poll() is None and time.monotonic() < deadline, "run ended or never checkpointed"
            time.sleep(0.2)
        actors = _children(proc.pid)  # the pipeline's generator and environment processes
        assert len(actors) >= 2
        proc.send_signal(signal.SIGKILL)  # no chance to clean up: whatever is on disk must be consistent
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in actors) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in actors if Path(f"/proc/{pid}").exists()], "actor processes outlived the killed trainer"
    checkpoint = latest_checkpoint(run)
    AutoModelForCausalLM.from_pretrained(checkpoint)
    step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    resumed = RunLoop(
        smoke(tmp_path, warm_cache, **{"run_dir": json.dumps(str(run)), "loop.steps": str(step + 1)}),
        resume=True,
        log=lambda *_: None,
        source="inline",
    )
    assert resumed.start_step == step
    assert resumed.run()["trained_samples"] == (step + 1) * 2 * 4


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def test_non_default_algorithm_runs_end_to_end(tmp_path, warm_cache):
    """The wiring of the option families at once: estimator, loss, correction, KL in the reward,
    entropy, overlong shaping and two epochs (no warm start: only the plumbing is under test)."""
    cfg = smoke(
        tmp_path,
        warm_cache,
        **{
            "loop.steps": "2",
            "warmstart.steps": "0",
            "trainer.advantage": "rloo",
            "trainer.loss": "gspo",
            "trainer.old_logprobs": "'trainer'",
            "trainer.correction": "mis",
            "trainer.correction_level": "sequence",
            "trainer.kl_coef": "0.05",
            "trainer.kl_placement": "reward",
            "trainer.entropy_coef": "0.01",
            "trainer.overlong": "penalty",
            "trainer.epochs": "2",
        },
    )
    train(cfg, log=lambda *_: None)
    lines = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "train/loss" in line]
    assert len(steps) == 2
    for key in (
        "offpolicy/ratio_mean",
        "offpolicy/masked_frac",
        "offpolicy/behaviour_kl",
        "train/entropy",
        "rollout/kl_ref_mean",
        "rollout/shaped_reward_mean",
    ):
        assert all(key in line for line in steps), key
    assert all(abs(line["offpolicy/ratio_mean"] - 1.0) < 1e-4 for line in steps)  # staleness 0
