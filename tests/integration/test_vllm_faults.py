"""A vLLM engine that wedges or fails in the middle of a run ends it with exit 3 and a diagnosis,
never a hang: `gapless train --generator.engine vllm` under the crash harness (no process may
outlive the run), with the fault point inside the real engine's step (faults.py, `vllm_step`: the
generator's vLLM step blocks for good without a heartbeat, or raises, before vLLM's own step).
The smoke run at head dim 32 (one head of 32), which vLLM's CPU attention runs. Each case starts
two vLLM engines (the trainer's eval engine, the generator's), about 1.5 minutes on 2 loaded cores:
CI runs the wedge; the error case is `slow` (by hand: -m vllm)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from crash import train

CONFIG = str(Path(__file__).parents[2] / "configs" / "smoke.toml")
STALL_S = 20.0  # above a step's weight push into vLLM on a loaded 2-core box
HANG_GUARD_S = 60.0
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


def _args(run: Path, warm_cache: Path) -> list[str]:
    return [
        CONFIG,
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--model.num_heads",
        "1",
        "--model.num_kv_heads",
        "1",
        "--generator.engine",
        "vllm",
        "--loop.steps",
        "3",
        "--loop.eval_every",
        "100",
        "--loop.checkpoint_every",
        "100",
        "--pipeline.max_staleness",
        "1",
        "--pipeline.stall_timeout_s",
        str(STALL_S),
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--metrics.tensorboard",
        "false",
    ]


def test_a_wedged_vllm_step_is_a_stall_with_the_diagnosis(tmp_path, warm_cache):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "run.err", "generator:vllm_step:12:hang", timeout_s=900)
    assert outcome.fault_time is not None, outcome.stderr[-3000:]
    assert outcome.rc == 3, outcome.stderr[-3000:]
    assert outcome.survivors == []
    assert outcome.ended - outcome.fault_time < STALL_S + HANG_GUARD_S
    assert "pipeline stalled" in outcome.stderr
    record = (run / "stall.txt").read_text()
    line = re.search(r"  generator: pid \d+, last heartbeat ([\d.]+) s ago", record)
    assert line and float(line.group(1)) >= STALL_S - 0.05, record  # silent: wedged inside the step
    stack = next((run / "stacks").glob("generator-*.txt")).read_text()
    assert "fault_point" in stack and "vllm/engine.py" in stack  # where: inside VLLMEngine.step


@pytest.mark.slow
def test_a_vllm_error_mid_run_ends_it_with_exit_3_and_the_cause(tmp_path, warm_cache):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "run.err", "generator:vllm_step:12:raise", timeout_s=900)
    assert outcome.fault_time is not None, outcome.stderr[-3000:]
    assert outcome.rc == 3, outcome.stderr[-3000:]
    assert outcome.survivors == []
    assert outcome.ended - outcome.fault_time < HANG_GUARD_S
    error = outcome.stderr.split("gapless: error:")[-1]
    assert "InjectedFault" in error and "generator" in error, outcome.stderr[-3000:]
    assert "--resume" in error
