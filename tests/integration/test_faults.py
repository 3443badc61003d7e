"""Crash consistency: kill or stop a pipeline process at a seeded point, then `--resume`.

Each case runs `gapless train` (configs/smoke.toml, budget 2, checkpoints every 2 steps) under
the crash harness with one fault (gapless/faults.py), then resumes it, and checks:
- a killed trainer takes every process with it; a killed actor stops the run with exit code 3
  and a message naming it, within seconds; a stopped (SIGSTOP) actor stops it within
  stall_timeout_s + 5 s with the diagnosis and the stacks written;
- `--resume` completes; the ledger keeps its rules (ledger.check_ledger) across the segments;
- no process and no semaphore of the run is left behind.
A few cases run in the fast suite; `test_fault_sweep` draws 20 seeded cases (slow).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
from crash import train

from gapless.cluster.ipc import run_key
from gapless.faults import POINTS
from gapless.orchestrate.ledger import check_ledger, read_events

CONFIG = str(Path(__file__).parents[2] / "configs" / "smoke.toml")
STEPS, GROUPS_PER_STEP, STALL_S = 6, 2, 4.0
HANG_GUARD_S = 60.0  # far beyond any reaction seen on a loaded 2-core machine (13 s); catches a hang, not slowness
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
MAX_COUNT = {"step": STEPS, "publish": STEPS, "checkpoint": 3, "decode": 80, "fetch": STEPS, "score": 4 * STEPS}


def _args(run: Path, warm_cache: Path) -> list[str]:
    return [
        CONFIG,
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--loop.steps",
        str(STEPS),
        "--loop.checkpoint_every",
        "2",
        "--loop.eval_every",
        "100",
        "--pipeline.max_staleness",
        "2",
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--pipeline.trainer_threads",
        "1",
        "--pipeline.stall_timeout_s",
        str(STALL_S),
        "--metrics.tensorboard",
        "false",
    ]


def _leftover_semaphores(run: Path) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"sem.mp-gapless-{run_key(run)}-*"))


def run_case(tmp_path: Path, warm_cache: Path, fault: str) -> None:
    run = tmp_path / "run"
    actor, _point, _count, action = (fault.split(":") + ["kill"])[:4]
    first = train(_args(run, warm_cache), tmp_path / "first.err", fault)
    assert first.survivors == [], f"{fault}: processes outlived the run: {first.survivors}"
    if first.fault_time is not None:  # the fault fired (a late point may come after the run ended)
        if actor == "trainer":
            assert first.rc == -9, first.stderr[-2000:]
        elif first.rc == 0:  # hit after its last needed group: the run finished all its steps without it
            assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
        else:
            assert first.rc == 3, first.stderr[-2000:]
            reacted_s = first.ended - first.fault_time
            # reaction times are measured by bench-style runs (docs/pipeline.md); here only a hang guard
            assert reacted_s < STALL_S + HANG_GUARD_S, f"{fault}: the run took {reacted_s:.1f} s to stop"
            if action == "stop":
                assert "pipeline stalled" in first.stderr and (run / "stall.txt").is_file()
                diagnosis = (run / "stall.txt").read_text()
                assert f"{actor}:" in diagnosis and "state T (stopped)" in diagnosis, diagnosis
                # the actor's last beat was at its stop, found within stall_timeout_s + 5 s of it. Not a
                # lower bound of stall_timeout_s: the stall is the trainer's wait passing the timeout, and
                # the actor may have beaten once after that wait began (measured: 3.9 s silent at a 4 s
                # wait, on a busy machine)
                silent = float(re.search(rf"{actor}: pid \d+, last heartbeat ([\d.]+) s ago", diagnosis).group(1))
                assert 0 < silent < STALL_S + 5, diagnosis
                stacks = list((run / "stacks").glob(f"{actor}-*.txt"))
                assert stacks and "File" in stacks[0].read_text(), "the stopped actor's stack was not written"
            else:
                assert f"gapless-{actor}" in first.stderr or f"the {actor} process failed" in first.stderr
            assert "Traceback" not in first.stderr.split("gapless: error:")[-1]  # one clear error, not a traceback
    else:
        assert first.rc == 0, first.stderr[-2000:]
    second = train(_args(run, warm_cache) + ["--resume"], tmp_path / "second.err")
    assert second.rc == 0, second.stderr[-3000:]
    assert second.survivors == []
    check_ledger(read_events(run / "groups.jsonl"), STEPS, GROUPS_PER_STEP)
    assert _leftover_semaphores(run) == []


@pytest.mark.parametrize(
    "fault",
    [  # the environment case is slow: the fast suite keeps a publish kill and a stall
        "trainer:publish:3",
        pytest.param("environment:score:3", marks=pytest.mark.slow),
        "generator:decode:5:stop",
    ],
)
def test_fault_then_resume(tmp_path, warm_cache, fault):
    run_case(tmp_path, warm_cache, fault)


def _sweep_faults(n: int, seed: int = 17) -> list[str]:
    rng = random.Random(seed)
    faults = []
    for _ in range(n):
        actor = rng.choice(sorted(POINTS))
        point = rng.choice(POINTS[actor])
        action = "stop" if actor != "trainer" and rng.random() < 0.25 else "kill"
        faults.append(f"{actor}:{point}:{rng.randint(1, MAX_COUNT[point])}:{action}")
    return faults


@pytest.mark.slow
@pytest.mark.parametrize("fault", _sweep_faults(20))
def test_fault_sweep(tmp_path, warm_cache, fault):
    run_case(tmp_path, warm_cache, fault)
