"""The asynchronous pipeline end to end with real processes, engine and sandbox.

Budget 0 must reproduce the reference synchronous loop exactly (same batches, so the same
weights); with a budget, every trained group respects it and every admitted group ends exactly
once in the ledger; dynamic sampling never trains a zero-variance group.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from gapless.config import load_config
from gapless.models import load_local
from gapless.orchestrate.loop import RunLoop

CONFIGS = Path(__file__).parents[2] / "configs"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _cfg(tmp_path, name, warm_cache, **extra):
    overrides = {
        "run_dir": json.dumps(str(tmp_path / name)),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "loop.steps": "4",
        "loop.eval_every": "100",
        "loop.checkpoint_every": "100",
        "trainer.threads": "1",
        "pipeline.generator_threads": "1",
        "pipeline.trainer_threads": "1",
        **{k: str(v) for k, v in extra.items()},
    }
    return load_config(CONFIGS / "smoke.toml", overrides)


def _metrics(run: Path) -> list[dict]:
    return [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "rollout/reward_mean" in line
    ]


def _ledger(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]


def test_budget_zero_equals_the_synchronous_loop(tmp_path, warm_cache):
    RunLoop(_cfg(tmp_path, "sync", warm_cache), log=lambda *_: None, source="inline").run()
    rendezvous_dirs = set(Path(tempfile.gettempdir()).glob("gapless-dp-*"))
    RunLoop(_cfg(tmp_path, "pipe", warm_cache), log=lambda *_: None, source="process").run()
    assert set(Path(tempfile.gettempdir()).glob("gapless-dp-*")) == rendezvous_dirs  # world 1 makes no rank store
    sync, pipe = _metrics(tmp_path / "sync"), _metrics(tmp_path / "pipe")
    for key in ("rollout/reward_mean", "rollout/completion_len_mean", "train/loss"):
        assert [m[key] for m in sync] == [m[key] for m in pipe], key
    a = load_local(tmp_path / "sync" / "checkpoints" / "step_4").model.state_dict()
    b = load_local(tmp_path / "pipe" / "checkpoints" / "step_4").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {m["staleness/max"] for m in pipe} == {0.0}


@pytest.mark.parametrize("budget,oversample,dynamic,partial_s", [(2, 0.0, False, 0.0), (1, 0.5, True, 0.02)])
def test_async_run_respects_the_budget_and_ends_every_group_once(
    tmp_path, warm_cache, budget, oversample, dynamic, partial_s
):
    cfg = _cfg(tmp_path, "run", warm_cache, **{"loop.steps": 6, "pipeline.max_staleness": budget,
               "pipeline.oversample": oversample, "pipeline.dynamic_sampling": str(dynamic).lower(),
               "pipeline.partial_rollout_tokens": 3, "pipeline.partial_rollout_s": partial_s,
               "generator.max_batch": 4})  # fmt: skip
    RunLoop(cfg, log=lambda *_: None, source="process").run()
    run = tmp_path / "run"
    events = _ledger(run)
    admitted = [e["group"] for e in events if e["event"] == "admitted"]
    ended = [e["group"] for e in events if e["event"] in ("trained", "dropped")]
    assert len(admitted) == len(set(admitted)) and Counter(ended) == Counter(admitted)  # exactly once
    trained = [e for e in events if e["event"] == "trained"]
    assert len(trained) == 6 * cfg.loop.prompts_per_step
    assert all(0 <= e["staleness"] <= budget for e in trained)
    if dynamic:
        assert all(len(set(e["rewards"])) > 1 for e in trained)  # never a zero-variance group
    assert max(m["staleness/max"] for m in _metrics(run)) <= budget
    assert (
        sum(m.get("generator/partial_cuts", 0) for m in _metrics(run)) > 0
    )  # groups of 8 on 4 slots: always someone waiting
    borrowed = [m["perf/trainer_borrowed_frac"] for m in _metrics(run)]  # core lending is on by default
    assert len(borrowed) == 6 and all(0.0 <= b <= 1.0 for b in borrowed)
