"""Every pipeline lever holds at every budget, and a run can be audited from its ledger alone.

- oversampling (1.0) at budgets 0, 1 and 2: every trained group within the budget, recomputed
  from the ledger's oldest-token versions; the ledger's rules hold; drops by reason in the ledger
  equal the run's cumulative drop metrics; the prompt pick counts come from the ledger's uids;
- dynamic sampling where no group can have signal stops within pipeline.max_resamples with a
  message naming the fix, every admitted group still ended once;
- SIGTERM (SIGINT) sent to the run's process group ends it with exit code 143 (130), in-flight groups dropped as 'run_stopped' (none left
  open for the resume to call lost), and a checkpoint `--resume` continues from.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from gapless.config import load_config
from gapless.orchestrate.ledger import check_ledger, read_events
from gapless.orchestrate.loop import RunLoop
from gapless.orchestrate.pipeline import ResamplesExhausted

ROOT = Path(__file__).parents[2]
SMOKE = ROOT / "configs" / "smoke.toml"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _overrides(run: Path, warm_cache: Path, **extra) -> dict[str, str]:
    return {
        "run_dir": json.dumps(str(run)),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "loop.eval_every": "100",
        "loop.checkpoint_every": "100",
        "trainer.threads": "1",
        "pipeline.generator_threads": "1",
        "pipeline.trainer_threads": "1",
        "metrics.tensorboard": "false",
        **{k: str(v) for k, v in extra.items()},
    }


@pytest.mark.parametrize(
    "budget", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)  # 0: the default
def test_oversampling_holds_the_budget_and_the_ledger_audits_the_run(tmp_path, warm_cache, budget):
    run = tmp_path / "run"
    cfg = load_config(
        SMOKE,
        _overrides(run, warm_cache, **{"loop.steps": 10, "pipeline.max_staleness": budget, "pipeline.oversample": 1.0}),
    )
    RunLoop(cfg, log=lambda *_: None, source="process").run()
    events = read_events(run / "groups.jsonl")
    check_ledger(events, 10, cfg.loop.prompts_per_step)
    trained = [e for e in events if e["event"] == "trained"]
    for e in trained:  # staleness recomputed from the oldest token's version, not taken on trust
        assert e["staleness"] == e["step"] - e["oldest_version"] and 0 <= e["staleness"] <= budget, e
        assert e["oldest_version"] >= e["born"] and len(e["rewards"]) == len(e["statuses"]) == cfg.generator.group_size
    drops = Counter(e["reason"] for e in events if e["event"] == "dropped")
    assert drops["straggler"] + drops["surplus"] > 0  # oversampling 1.0 always leaves some behind
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "perf/step_s" in line][-1]
    drops.pop("run_ended", None)  # written when the run closes, after the last step's metrics
    assert {k[len("drops/") : -len("_total")]: v for k, v in last.items() if k.endswith("_total")} == drops
    picks = Counter(e["uid"] for e in events if e["event"] == "admitted")
    assert sum(picks.values()) == sum(1 for e in events if e["event"] == "admitted") and None not in picks


def test_dynamic_sampling_without_any_signal_stops_within_its_bound(tmp_path, warm_cache):
    run = tmp_path / "run"
    # near-greedy sampling: every completion of a prompt is the same, so every group has zero variance
    cfg = load_config(
        SMOKE,
        _overrides(
            run,
            warm_cache,
            **{
                "loop.steps": 3,
                "pipeline.dynamic_sampling": "true",
                "pipeline.max_resamples": 6,
                "generator.temperature": 0.001,
            },
        ),
    )
    with pytest.raises(ResamplesExhausted, match="pipeline.max_resamples = 6"):
        RunLoop(cfg, log=lambda *_: None, source="process").run()
    events = read_events(run / "groups.jsonl")
    reasons = Counter(e["reason"] for e in events if e["event"] == "dropped")
    assert reasons["zero_variance"] >= 6
    admitted = [e["group"] for e in events if e["event"] == "admitted"]
    ended = [e["group"] for e in events if e["event"] in ("trained", "dropped")]
    assert sorted(admitted) == sorted(ended)  # still exactly once: the rest ended as run_failed


@pytest.mark.parametrize(
    "signum, exit_code", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)]
)
def test_a_stop_signal_checkpoints_drops_in_flight_as_run_stopped_and_resumes(tmp_path, warm_cache, signum, exit_code):
    run = tmp_path / "run"
    args = [
        str(SMOKE),
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--loop.steps",
        "40",
        "--loop.eval_every",
        "100",
        "--loop.checkpoint_every",
        "100",
        "--pipeline.max_staleness",
        "1",
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--pipeline.trainer_threads",
        "1",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gapless.cli", "train", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not metrics.is_file() or metrics.read_text().count("perf/step_s") < 3):
        time.sleep(0.2)
    os.killpg(proc.pid, signum)  # to the whole group, as a terminal's Ctrl-C or a scheduler does
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == exit_code, stderr[-2000:]
    assert f"stopped by {signal.Signals(signum).name}" in stderr
    state = json.loads(
        (run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "trainer_state.json").read_text()
    )
    assert 3 <= state["step"] < 40
    done = subprocess.run(
        [sys.executable, "-m", "gapless.cli", "train", *args, "--loop.steps", str(state["step"] + 2), "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    events = read_events(run / "groups.jsonl")
    check_ledger(events, state["step"] + 2, 2)
    # the stop closed everything it had admitted itself (as run_stopped when any was in flight):
    # nothing of segment 0 was left for the resume to call lost, and no step after its checkpoint was trained
    assert not [e for e in events if e.get("reason") == "run_lost" or e["event"] == "rolled_back"]
    stopped = [e for e in events if e.get("reason") == "run_stopped"]
    assert all(e["segment"] == 0 for e in stopped)
