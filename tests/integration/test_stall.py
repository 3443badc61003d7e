"""The stall watch measures progress, not arrivals (cluster/watchdog.py), on real runs.

- A run whose one group takes longer to generate than pipeline.stall_timeout_s, decoding all the
  while, completes: the trainer's wait for it (read from its timeline) outlasts the timeout.
- A generator that stays alive and keeps its heartbeat but makes no progress (fault action
  'hang' after a decode step) stops the run as stalled, with a record that names the decode step
  it last progressed on and when, and a heartbeat that was fresh: found by progress, not by
  silence.
Both are `gapless train` under the crash harness (no process may outlive the run).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from crash import train

CONFIG = str(Path(__file__).parents[2] / "configs" / "smoke.toml")
STALL_S = 2.5
LONG_TOKENS = 4096  # one group of 4 forced to this length decodes for about 2.5 x STALL_S on an idle 2-core box
HANG_GUARD_S = 60.0  # catches a hang of the watch itself, not slowness
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _args(run: Path, warm_cache: Path) -> list[str]:
    return [
        CONFIG,
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--loop.steps",
        "1",
        "--loop.prompts_per_step",
        "1",
        "--loop.eval_every",
        "100",
        "--loop.checkpoint_every",
        "100",
        "--generator.max_new_tokens",
        str(LONG_TOKENS),
        "--generator.force_long_every",
        "1",
        "--pipeline.max_staleness",
        "0",
        "--pipeline.stall_timeout_s",
        str(STALL_S),
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--metrics.tensorboard",
        "false",
    ]


def _wait_s(run: Path) -> float:
    """The trainer's wait for step 1's rollouts, from its timeline."""
    spans = [
        json.loads(line)
        for path in (run / "timeline").glob("trainer-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    wait = next(s for s in spans if s.get("name") == "wait_rollouts" and s["args"]["step"] == 0)
    return wait["end"] - wait["start"]


def test_a_group_longer_than_the_stall_timeout_that_keeps_decoding_completes(tmp_path, warm_cache):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "run.err")
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == []
    assert not (run / "stall.txt").exists()
    waited = _wait_s(run)
    # the case under test: with a shorter wait the run proves nothing (lengthen the rollouts)
    assert waited > STALL_S, f"the trainer waited only {waited:.1f} s for the long group"
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_a_live_generator_without_progress_is_a_stall_named_by_its_last_progress(tmp_path, warm_cache):
    run = tmp_path / "run"
    outcome = train(_args(run, warm_cache), tmp_path / "run.err", "generator:decode:30:hang")
    assert outcome.fault_time is not None, outcome.stderr[-3000:]
    assert outcome.rc == 3, outcome.stderr[-3000:]
    assert outcome.survivors == []
    assert outcome.ended - outcome.fault_time < STALL_S + HANG_GUARD_S
    assert "pipeline stalled" in outcome.stderr and "Traceback" not in outcome.stderr.split("gapless: error:")[-1]
    record = (run / "stall.txt").read_text()
    assert "none of which made progress" in record, record
    line = re.search(r"  generator: pid \d+, last heartbeat ([\d.]+) s ago, state (\S+) .*?; (.*)", record)
    assert line, record
    heartbeat_s, state, progress = float(line.group(1)), line.group(2), line.group(3)
    assert heartbeat_s < STALL_S and state != "T", record  # alive and beating: not a silent or stopped process
    last = re.search(
        r"progress mark \d+, the last ([\d.]+) s ago \(at \d\d:\d\d:\d\d\): a decode step of \d+ tokens", progress
    )
    assert last, record
    assert float(last.group(1)) >= STALL_S - 0.05, record  # rounded to 0.1 s in the record
    assert re.search(r"  environment: pid \d+, .*set up: environment ready", record), record
    stack = next((run / "stacks").glob("generator-*.txt")).read_text()
    assert "fault_point" in stack  # where it hangs
