"""Infrastructure outages in the pipeline: retried with backoff, never trained on, and a
sustained one stops the run with an InfraUnavailable (exit code 3 from the CLI); held-out
evaluation during an outage leaves the failures out of pass@1 and counts them.

The judge task against a real local HTTP judge that answers 503 while it is 'down': a short
outage is ridden out by the environment's retries (every group is trained, none on a failed
score); a permanent one ends the run within pipeline.outage_s and the ledger holds no trained
group with an infra_error rollout.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from judge_stub import Reply, completion_reply, serving

from gapless.config import load_config
from gapless.envs.base import InfraUnavailable
from gapless.orchestrate.ledger import check_ledger, read_events
from gapless.orchestrate.loop import RunLoop

SMOKE = Path(__file__).parents[2] / "configs" / "smoke.toml"


class FlakyJudge:
    """Score: the response's length mod 11 (so groups have variance); 503 for `down_s` from the
    first request on (the run's first eval sends it, before the actors have anything to score)."""

    def __init__(self, down_s: float = 0.0):
        self.down_s, self.down_until, self.refused = down_s, None, 0

    def __call__(self, body) -> Reply:
        if self.down_until is None:
            self.down_until = time.monotonic() + self.down_s
        if time.monotonic() < self.down_until:
            self.refused += 1
            return Reply(503, b"down for maintenance")
        return completion_reply(f"Score: {len(body['prompt'].split('<response>', 1)[-1]) % 11}")


def _cfg(run: Path, url: str, **extra):
    overrides = {
        "run_dir": json.dumps(str(run)),
        "task.name": "judge",
        "judge.base_url": json.dumps(url),
        "judge.max_retries": "0",
        "judge.timeout_s": "2",
        "warmstart.steps": "0",
        "loop.steps": "4",
        "loop.eval_every": "100",
        "loop.checkpoint_every": "100",
        "trainer.threads": "1",
        "pipeline.generator_threads": "1",
        "pipeline.trainer_threads": "1",
        "metrics.tensorboard": "false",
        **{k: str(v) for k, v in extra.items()},
    }
    return load_config(SMOKE, overrides)


def _trained_on_infra(run: Path) -> list[dict]:
    return [e for e in read_events(run / "groups.jsonl") if e["event"] == "trained" and "infra_error" in e["statuses"]]


def test_a_short_outage_is_retried_not_trained_on(tmp_path):
    run, judge = tmp_path / "run", FlakyJudge(down_s=4.0)  # down as the run starts
    with serving(judge) as url:
        cfg = _cfg(run, url, **{"pipeline.infra_retries": 4, "pipeline.outage_s": 60})
        RunLoop(cfg, log=lambda *_: None, source="process").run()
    assert judge.refused > 0  # the outage happened
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert evals[0]["eval/infra_errors"] > 0  # the first eval ran during the outage: its failures are counted
    for m in evals:  # left out of pass@1, which is NaN only when nothing could be scored
        assert math.isnan(m["eval/pass@1"]) or 0 <= m["eval/pass@1"] <= 1
    events = read_events(run / "groups.jsonl")
    check_ledger(events, 4, cfg.loop.prompts_per_step)
    assert _trained_on_infra(run) == []


def test_a_sustained_outage_stops_the_run(tmp_path):
    run = tmp_path / "run"
    with serving(FlakyJudge(down_s=3600.0)) as url:
        cfg = _cfg(run, url, **{"pipeline.infra_retries": 1, "pipeline.outage_s": 3})
        with pytest.raises(InfraUnavailable, match="pipeline.outage_s"):
            RunLoop(cfg, log=lambda *_: None, source="process").run()
    assert _trained_on_infra(run) == []
    events = read_events(run / "groups.jsonl")
    assert any(e.get("reason") == "infra_error" for e in events)
