"""Generator replicas with central admission (cluster.replicas), and what a lost replica does.

Two replicas at budget 1 share one staleness budget and one ledger. A replica killed (SIGKILL) or
stopped (SIGSTOP) in the middle of the run is evicted: its groups end as `replica_lost`, places
are backfilled on the others, a fresh replica takes its slot (the run does not wait for it to
start), and the run completes with every admitted group ended exactly once and every trained
staleness within the budget.
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
STEPS, BUDGET, OP_TIMEOUT_S = 6, 1, 3.0
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _args(run: Path, warm_cache: Path) -> list[str]:
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
        "--cluster.replicas",
        "2",
        "--cluster.op_timeout_s",
        str(OP_TIMEOUT_S),
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--pipeline.trainer_threads",
        "1",
        "--metrics.tensorboard",
        "false",
    ]


def _check_run(run: Path) -> dict:
    events = read_events(run / "groups.jsonl")
    check_ledger(events, STEPS, 2)  # every admitted group ends exactly once; each step trained once
    trained = [e for e in events if e["event"] == "trained"]
    assert trained and all(0 <= e["staleness"] <= BUDGET for e in trained)
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    return json.loads((run / "staleness.json").read_text())


@pytest.mark.parametrize("action", ["kill", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_lost_replica_is_evicted_and_the_run_completes(tmp_path, warm_cache, action):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "err.txt", f"generator-1:decode:3:{action}", timeout_s=900)
    assert outcome.fault_time is not None, outcome.stderr[-2000:]  # replica 1 was hit
    assert outcome.rc == 0, outcome.stderr[-2000:]
    assert outcome.survivors == [], outcome.survivors
    summary = _check_run(run)
    evicted = [e for e in summary["evictions"] if e["replica"] == "generator-1"]
    assert len(evicted) == 1, summary["evictions"]
    if action == "stop":  # a silent replica is evicted at the operation timeout, not before
        assert evicted[0]["silent_s"] >= OP_TIMEOUT_S
    held = sum(1 for e in read_events(run / "groups.jsonl") if e.get("reason") == "replica_lost")
    assert held == summary["drops"].get("replica_lost", 0)
    # only the first step waited for the actors to start: the run went on while the replacement started
    waits = [r for r in read_records(run) if r["actor"] == "trainer" and r["name"] == "wait_actors_start"]
    assert len(waits) == 1, waits


@pytest.mark.slow
def test_two_replicas_share_one_budget(tmp_path, warm_cache):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "err.txt", timeout_s=900)
    assert outcome.rc == 0 and outcome.survivors == [], outcome.stderr[-2000:]
    assert _check_run(run)["evictions"] == []
    generated = {r["actor"] for r in read_records(run) if r["name"] == "generate"}
    assert generated == {"generator-0", "generator-1"}  # both replicas decoded


@pytest.mark.slow
def test_two_replicas_and_two_trainer_ranks_survive_a_killed_replica(tmp_path, warm_cache):
    """The headline scenario on local placement: 2 replicas, the environment, trainer world 2,
    budget 1; replica 1 is SIGKILLed mid-run."""
    run = tmp_path / "run"
    args = _args(run, warm_cache) + ["--cluster.trainer_world_size", "2"]
    outcome = train(args, tmp_path / "err.txt", "generator-1:decode:3:kill", timeout_s=900)
    assert outcome.fault_time is not None and outcome.rc == 0, outcome.stderr[-2000:]
    assert outcome.survivors == [], outcome.survivors
    assert [e["replica"] for e in _check_run(run)["evictions"]] == ["generator-1"]
