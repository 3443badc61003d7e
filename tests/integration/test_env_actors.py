"""Several environment actors (cluster.env_actors), and what a lost one does.

Two environment actors at budget 1 score the groups the trainer routes to each. One killed
(SIGKILL) or stopped (SIGSTOP) in the middle of the run is evicted: the groups routed to it end as
`env_lost` (those still generating are aborted on their replica), places are backfilled, a fresh
environment actor takes its slot, and the run completes with every admitted group ended exactly
once and every trained staleness within the budget.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from crash import train

from gapless.orchestrate.ledger import check_ledger, read_events
from gapless.timeline import read_records

CONFIG = str(Path(__file__).parents[2] / "configs" / "smoke.toml")
STEPS, BUDGET, OP_TIMEOUT_S, GROUPS_PER_STEP = 6, 1, 3.0, 2
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _args(run: Path, warm_cache: Path, *extra: str) -> list[str]:
    return [
        CONFIG,
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--loop.steps",
        str(STEPS),
        "--loop.eval_every",
        "100",
        "--pipeline.max_staleness",
        str(BUDGET),
        "--cluster.env_actors",
        "2",
        "--cluster.op_timeout_s",
        str(OP_TIMEOUT_S),
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--pipeline.trainer_threads",
        "1",
        "--pipeline.env_workers",
        "2",
        "--metrics.tensorboard",
        "false",
        *extra,
    ]


def _check_run(run: Path) -> tuple[list[dict], dict]:
    events = read_events(run / "groups.jsonl")
    check_ledger(events, STEPS, GROUPS_PER_STEP)  # every admitted group ends exactly once; each step trained once
    trained = [e for e in events if e["event"] == "trained"]
    assert trained and all(0 <= e["staleness"] <= BUDGET for e in trained)
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    return events, json.loads((run / "staleness.json").read_text())


@pytest.mark.parametrize("action", ["kill", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_lost_environment_actor_is_evicted_and_the_run_completes(tmp_path, warm_cache, action):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "err.txt", f"environment-1:score:2:{action}", timeout_s=900)
    assert outcome.fault_time is not None, outcome.stderr[-2000:]  # environment actor 1 was hit
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == [], outcome.survivors
    events, summary = _check_run(run)
    evicted = [e for e in summary["env_evictions"] if e["environment"] == "environment-1"]
    assert len(evicted) == 1 and summary["evictions"] == [], summary
    if action == "stop":  # a silent actor is evicted at the operation timeout, not before
        assert evicted[0]["silent_s"] >= OP_TIMEOUT_S
    lost = sum(1 for e in events if e.get("reason") == "env_lost")
    assert lost >= 1 and lost == summary["drops"]["env_lost"]  # it held the group it was scoring
    scored_by = {r["actor"] for r in read_records(run) if r["name"] == "score"}
    assert {"env-0", "env-1"} <= scored_by  # both actors scored


def test_a_multi_turn_task_refuses_several_environment_actors(tmp_path, warm_cache):
    outcome = train(_args(tmp_path / "run", warm_cache, "--task.name", "tool_use"), tmp_path / "err.txt", timeout_s=300)
    assert outcome.rc != 0 and "cluster.env_actors = 1" in outcome.stderr, outcome.stderr[-2000:]
