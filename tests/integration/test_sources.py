"""The rollout-source contract (orchestrate/source.py), run over every source and placement.

Each source is driven through the Protocol alone, as the run loop drives it: start, then per step
take -> GRPO step -> publish -> stats, then close. Checked: the shape of every step (P groups of N
rollouts), every token's version within [t - budget, t], the weights published at step t sampling
from step t + 1 on (budget 0), and equality of the inline and process sources at budget 0.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gapless.cluster.placement import LocalPlacement, Placement
from gapless.config import load_config
from gapless.orchestrate.loop import RunLoop
from gapless.orchestrate.source import RolloutSource
from gapless.trainer.targets import step_batch

CONFIGS = Path(__file__).parents[2] / "configs"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
STEPS = 3


def _loop(tmp_path, warm_cache, kind: str, budget: int, placement: str = "local", **extra: str) -> RunLoop:
    overrides = {
        **extra,
        "run_dir": json.dumps(str(tmp_path / f"{kind}-{placement}-{budget}")),
        "cluster.placement": json.dumps(placement),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "loop.steps": str(STEPS),
        "trainer.threads": "1",
        "pipeline.generator_threads": "1",
        "pipeline.trainer_threads": "1",
        "pipeline.max_staleness": str(budget),
    }
    return RunLoop(load_config(CONFIGS / "smoke.toml", overrides), log=lambda *_: None, source=kind)


def _drive(loop: RunLoop, budget: int) -> list[list[list[int]]]:
    """Run STEPS steps through the source's Protocol; returns each step's sampled token ids."""
    cfg, source = loop.cfg, loop.source
    assert isinstance(source, RolloutSource)
    source.start(loop.trainer.state_for_push(), loop.trainer.version)
    sampled, reason = [], "run_failed"
    try:
        for step in range(STEPS):
            taken = source.take(step)
            assert len(taken.groups) == cfg.loop.prompts_per_step
            assert all(len(group.rollouts) == cfg.generator.group_size for group in taken.groups)
            versions = [v for r in taken.rollouts for v in r.completion.versions]
            assert versions and all(step - budget <= v <= step for v in versions), (step, sorted(set(versions)))
            if budget == 0:  # synchronous: the weights published after step t - 1 sampled all of step t
                assert set(versions) == {step}
            batch, _ = step_batch(
                taken.groups, cfg.trainer, cfg.generator.max_new_tokens, loop.policy.pad_id, loop.trainer.reference_kl
            )
            with source.training():
                loop.trainer.step(batch)
            assert isinstance(source.publish(loop.trainer.state_for_push(), loop.trainer.version), dict)
            assert all(isinstance(v, float) for v in source.stats().values())
            sampled.append(sorted(r.completion.token_ids for r in taken.rollouts))
        reason = "run_ended"
    finally:
        source.close(reason, loop.trainer.version)
        loop.sinks.close()
        loop.env.close()
    return sampled


def test_every_source_keeps_the_contract_and_budget_zero_sources_agree(tmp_path, warm_cache):
    inline = _drive(_loop(tmp_path, warm_cache, "inline", 0), 0)
    process = _drive(_loop(tmp_path, warm_cache, "process", 0), 0)
    assert inline == process  # same prompts, seeds and weights: the same tokens at every step


@pytest.mark.slow  # about 30 s: two more loops, one spawning the actors
def test_budget_zero_sources_agree_bitwise_with_lora(tmp_path, warm_cache):
    """A LoRA run pushes adapters only: the process source's generator merges them into the base
    it loaded from disk, the inline one into the trainer's own frozen base; same tokens."""
    lora = {"lora.rank": "4", "trainer.lr": "3e-2"}
    inline_loop = _loop(tmp_path, warm_cache, "inline", 0, **lora)
    assert all("lora_" in name for name in inline_loop.trainer.state_for_push())
    inline = _drive(inline_loop, 0)
    process = _drive(_loop(tmp_path / "p", warm_cache, "process", 0, **lora), 0)
    assert inline == process
    assert any(float(t.abs().sum()) > 0 for name, t in inline_loop.trainer.state_for_push().items() if "lora_B" in name)


def test_the_process_source_keeps_the_contract_with_a_budget(tmp_path, warm_cache):
    _drive(_loop(tmp_path, warm_cache, "process", 1), 1)
    assert not [
        p.name for p in multiprocessing.active_children() if p.name.startswith("gapless-")
    ]  # close stopped the actors


def test_the_environment_actor_counts_the_groups_it_scores_for_the_trainers_lending(tmp_path, warm_cache):
    """With core lending (budget 1, one local replica), the environment process raises the shared
    scoring count around each group it scores (orchestrate/lending.py): seen from the trainer's
    process during a take, it rises and never exceeds the environment's workers."""
    loop = _loop(tmp_path, warm_cache, "process", 1)
    source = loop.source
    assert source.lending is not None and not source.lending.while_scoring  # the default: no lending while scoring
    counts, done = [], threading.Event()

    def watch():
        while not done.is_set():
            counts.append(source.lending.flags._scoring.value)
            time.sleep(0.0005)

    source.start(loop.trainer.state_for_push(), loop.trainer.version)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        source.take(0)
    finally:
        done.set()
        watcher.join()
        source.close("run_ended", 1)
        loop.sinks.close()
        loop.env.close()
    assert 1 <= max(counts) <= loop.cfg.pipeline.env_workers and min(counts) >= 0


def test_the_process_source_admits_a_new_versions_groups_while_the_trainer_trains(tmp_path, warm_cache):
    """Budget 1, pipeline.admit_while_training = 'on': version 0 allows 2 P groups; the Loaded of
    version 1 arrives while the trainer is inside training(), and the groups it allows are
    admitted then, not at the next take. 'auto' is 'off' here: the trainer borrows the
    generator's core (one local replica, lend_idle_cores)."""
    auto = _loop(tmp_path / "auto", warm_cache, "process", 1)
    assert auto.source.admit_while_training is False
    auto.sinks.close()
    auto.env.close()
    loop = _loop(tmp_path, warm_cache, "process", 1, **{"pipeline.admit_while_training": '"on"'})
    source, admission = loop.source, loop.source.dispatcher.admission
    source.start(loop.trainer.state_for_push(), loop.trainer.version)
    try:
        source.take(0)
        before = admission.admitted
        assert before == admission.limit(0)
        source.publish(loop.trainer.state_for_push(), 1)
        with source.training():
            deadline = time.monotonic() + 120
            while admission.admitted < admission.limit(1) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert admission.admitted == admission.limit(1) > before
        assert 1 in source.buffer.in_flight.values()  # born at version 1
        assert isinstance(source.take(1).groups, list)  # what arrived meanwhile was kept for it
    finally:
        source.close("run_ended", 1)
        loop.sinks.close()
        loop.env.close()


@pytest.mark.slow
def test_the_ray_placement_keeps_the_contract_and_agrees_with_inline_at_budget_zero(tmp_path, warm_cache):
    pytest.importorskip("ray")
    inline = _drive(_loop(tmp_path, warm_cache, "inline", 0), 0)
    placed = _drive(_loop(tmp_path, warm_cache, "process", 0, "ray"), 0)
    assert inline == placed


def test_every_placement_implements_the_protocol():
    assert isinstance(LocalPlacement(), Placement)
    ray_placement = pytest.importorskip("gapless.cluster.ray.placement")
    members = [m for m in vars(Placement) if not m.startswith("_")]
    assert all(hasattr(ray_placement.RayPlacement, m) for m in members if m != "ctx"), members


RUN_AND_LIST_MODULES = """
import json, sys
from gapless.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "ray": sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))}))
"""


@pytest.mark.slow
def test_a_local_run_never_imports_ray(tmp_path, warm_cache):
    """The default placement runs the whole pipeline (generator and environment processes) without
    Ray in the trainer's process (the actors import only what the trainer sends them)."""
    args = [
        str(CONFIGS / "smoke.toml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--loop.steps",
        "1",
        "--loop.eval_every",
        "100",
        "--pipeline.max_staleness",
        "1",
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--pipeline.trainer_threads",
        "1",
        "--metrics.tensorboard",
        "false",
    ]
    done = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_MODULES, "train", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src")),
    )
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {"rc": 0, "ray": []}, done.stderr[-2000:]
