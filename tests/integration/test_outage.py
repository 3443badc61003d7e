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
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gapless.config import load_config
from gapless.envs.base import InfraUnavailable
from gapless.orchestrate.ledger import check_ledger, read_events
from gapless.orchestrate.loop import RunLoop

SMOKE = Path(__file__).parents[2] / "configs" / "smoke.toml"


class FlakyJudge(BaseHTTPRequestHandler):
    """Score: the response's length mod 11 (so groups have variance); 503 for `down_s` from the
    first request on (the run's first eval sends it, before the actors have anything to score)."""

    protocol_version = "HTTP/1.1"
    down_s = 0.0
    down_until: float | None = None
    refused = 0

    def do_POST(self):  # noqa: N802
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        if FlakyJudge.down_until is None:
            FlakyJudge.down_until = time.monotonic() + FlakyJudge.down_s
        if time.monotonic() < FlakyJudge.down_until:
            FlakyJudge.refused += 1
            data, code = b"down for maintenance", 503
        else:
            score = len(prompt.split("<response>", 1)[-1]) % 11
            data, code = json.dumps({"choices": [{"text": f"Score: {score}"}]}).encode(), 200
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FlakyJudge)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


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


def test_a_short_outage_is_retried_not_trained_on(tmp_path, judge_url):
    run = tmp_path / "run"
    cfg = _cfg(run, judge_url, **{"pipeline.infra_retries": 4, "pipeline.outage_s": 60})
    pipeline = RunLoop(cfg, log=lambda *_: None, source="process")
    FlakyJudge.refused, FlakyJudge.down_s, FlakyJudge.down_until = 0, 4.0, None  # down as the run starts
    pipeline.run()
    assert FlakyJudge.refused > 0  # the outage happened
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert evals[0]["eval/infra_errors"] > 0  # the first eval ran during the outage: its failures are counted
    for m in evals:  # left out of pass@1, which is NaN only when nothing could be scored
        assert math.isnan(m["eval/pass@1"]) or 0 <= m["eval/pass@1"] <= 1
    events = read_events(run / "groups.jsonl")
    check_ledger(events, 4, cfg.loop.prompts_per_step)
    assert _trained_on_infra(run) == []


def test_a_sustained_outage_stops_the_run(tmp_path, judge_url):
    run = tmp_path / "run"
    cfg = _cfg(run, judge_url, **{"pipeline.infra_retries": 1, "pipeline.outage_s": 3})
    pipeline = RunLoop(cfg, log=lambda *_: None, source="process")
    FlakyJudge.down_s, FlakyJudge.down_until = 3600.0, None
    with pytest.raises(InfraUnavailable, match="pipeline.outage_s"):
        pipeline.run()
    assert _trained_on_infra(run) == []
    events = read_events(run / "groups.jsonl")
    assert any(e.get("reason") == "infra_error" for e in events)
