"""`gapless train --cluster.trainer_world_size 2` end to end on the smoke job: the run trains
and checkpoints as at world 1 (FSDP2); the checkpoint resumes under DDP; a killed trainer rank
ends that run with exit code 3 and an error naming the rank, no process is left behind, and
`--resume` finishes the job."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from gapless.cluster.watchdog import process_state
from gapless.trainer.checkpoint import latest_checkpoint

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.slow]


def gapless_train(run: Path, cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gapless.cli",
        "train",
        str(ROOT / "configs" / "smoke.toml"),
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        json.dumps(str(cache)),
        "--cluster.trainer_world_size",
        "2",
        *extra,
    ]


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def orphan_ranks() -> list[int]:
    """Live rank processes whose trainer is gone (re-parented to init)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and comm(int(proc.name)).startswith("gapless-rank"):
            with contextlib.suppress(OSError):
                status = dict(
                    line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line
                )
                if status.get("PPid", "").strip() == "1" and not status.get("State", "").startswith("Z"):
                    out.append(int(proc.name))
    return out


def trained_steps(run: Path) -> list[int]:
    return [
        json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if "train/loss" in line
    ]


def test_world_2_trains_and_a_killed_rank_stops_the_run_which_resumes(tmp_path, warm_cache):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    run = tmp_path / "run"
    done = subprocess.run(
        gapless_train(run, warm_cache, "--loop.steps", "2", "--cluster.data_parallel", "fsdp2"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert trained_steps(run) == [1, 2]
    AutoModelForCausalLM.from_pretrained(latest_checkpoint(run))  # plain HF format, gathered on rank 0
    assert not orphan_ranks(), "a rank outlived its run"

    proc = subprocess.Popen(
        gapless_train(run, warm_cache, "--loop.steps", "40", "--loop.checkpoint_every", "1", "--resume"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while latest_checkpoint(run).name in ("step_2", "step_3"):
            assert proc.poll() is None and time.monotonic() < deadline, "the resumed run ended or never checkpointed"
            time.sleep(0.2)
        children = descendants(proc.pid)
        ranks = [pid for pid in children if comm(pid) == "gapless-rank1"]
        assert len(ranks) == 1, [(pid, comm(pid)) for pid in children]
        os.kill(ranks[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, stderr[-3000:]
    assert "trainer rank 1" in stderr and "--resume" in stderr
    deadline = (
        time.monotonic() + 15
    )  # the actors' own children (sandboxes, the resource tracker) exit after the trainer
    while (
        left := [pid for pid in children if not process_state(pid).startswith(("gone", "Z"))]
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes outlived the run: {[(pid, comm(pid)) for pid in left]}"

    step = json.loads((latest_checkpoint(run) / "trainer_state.json").read_text())["step"]
    done = subprocess.run(
        gapless_train(run, warm_cache, "--loop.steps", str(step + 1), "--resume"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert trained_steps(run)[-1] == step + 1
