"""`gapless simulate --calibrate` on real runs: two tiny pipeline runs (budgets 0 and 1) of the
smoke job are read (config, metrics, timeline), calibrated together, each predicted back from the
fitted costs, and the costs drive `gapless simulate`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gapless.simulate.costs import Costs

ROOT = Path(__file__).parents[2]
SMOKE = ROOT / "configs" / "smoke.toml"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


def test_calibrate_on_tiny_real_runs(tmp_path, warm_cache):
    runs = []
    for budget in (0, 1):
        run = tmp_path / f"b{budget}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gapless.cli",
                "train",
                str(SMOKE),
                "--run-dir",
                str(run),
                "--warmstart.cache_dir",
                str(warm_cache),
                "--loop.steps",
                "6",
                "--loop.eval_every",
                "100",
                "--loop.checkpoint_every",
                "100",
                "--metrics.tensorboard",
                "false",
                "--pipeline.max_staleness",
                str(budget),
            ],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        runs.append(str(run))
    costs_path = tmp_path / "costs.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "simulate",
            "--calibrate",
            *runs,
            "--simulate.costs_path",
            str(costs_path),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    costs = Costs.load(costs_path)  # valid: finite, non-negative
    assert costs.source.startswith("calibrated on")
    assert costs.barrier_teams and costs.decode_first  # CPU runs: the pool's rules for this engine on cores
    for row in out["runs"]:
        # 6 steps of 8 samples each, on whatever else the machine runs: the figures must come back
        # finite and of the right order; accuracy is bench/simulator.py's job (docs/simulator.md)
        assert 1 / 3 < row["predicted_ms_per_sample"] / row["measured_ms_per_sample"] < 3, row
        assert 0.0 <= row["predicted_trainer_idle"] <= 1.0 and 0.0 <= row["predicted_generator_idle"] <= 1.0, row
    # the fitted costs drive a simulation of the same job
    sim = subprocess.run(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "simulate",
            str(SMOKE),
            "--run-dir",
            str(tmp_path / "sim"),
            "--simulate.costs_path",
            str(costs_path),
            "--pipeline.max_staleness",
            "1",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert json.loads(sim.stdout.strip().splitlines()[-1])["summary"]["staleness_max"] <= 1
