"""Masking is watched (orchestrate/masking.py), in the synchronous loop and in the pipeline with a
staleness budget: a real local HTTP judge that answers 503 to every request about one prompt makes
that prompt's rollouts `infra_error` whenever it is drawn, while the other prompts are scored.

    pipeline.on_infra_excess = 'fail'  the prompt is flagged, its masked rollouts from the flag on
                                       are trained as failures (status 'infra_excess', reward 0),
                                       the run ends normally and masking.json names it
    pipeline.on_infra_excess = 'stop'  the run ends with MaskingExcess (exit code 3) naming it
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from judge_stub import Reply, completion_reply, serving

from gapless.config import load_config
from gapless.orchestrate.ledger import check_ledger, read_events
from gapless.orchestrate.loop import RunLoop
from gapless.orchestrate.masking import EXCESS_STATUS, MaskingExcess

SMOKE = Path(__file__).parents[2] / "configs" / "smoke.toml"
BROKEN = "Describe the colour of silence."  # the judge never answers about this prompt
# train task 2 is drawn at steps 0, 1, 2 and 3 of seed 0 (admission.sample_step_tasks, 4 tasks, 2 per step)
TASKS = [
    ("t0", "Name a fruit.", "train"),
    ("t1", "Name a colour.", "train"),
    ("broken", BROKEN, "train"),
    ("t3", "Name an animal.", "train"),
    ("e0", "Name a tree.", "eval"),
    ("e1", "Name a metal.", "eval"),
]


def selective(body) -> Reply:
    """Score: the response's length mod 11; 503 for every request about the BROKEN prompt."""
    if BROKEN in body["prompt"]:
        return Reply(503, b"this prompt is never judged")
    return completion_reply(f"Score: {len(body['prompt'].split('<response>', 1)[-1]) % 11}")


@pytest.fixture(scope="module")
def judge_url():
    with serving(selective) as url:
        yield url


def _cfg(tmp_path: Path, url: str, budget: int, action: str):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"uid": u, "prompt": p, "reference": "", "split": s}) + "\n" for u, p, s in TASKS)
    )
    overrides = {
        "run_dir": json.dumps(str(tmp_path / "run")),
        "task.name": "judge",
        "judge.base_url": json.dumps(url),
        "judge.tasks_path": json.dumps(str(tasks)),
        "judge.max_retries": "0",
        "judge.timeout_s": "5",
        "warmstart.steps": "0",
        "loop.steps": "4",
        "loop.eval_every": "100",
        "loop.checkpoint_every": "100",
        "trainer.threads": "1",
        "pipeline.generator_threads": "1",
        "pipeline.trainer_threads": "1",
        "pipeline.infra_retries": "0",
        "pipeline.max_staleness": str(budget),
        "pipeline.on_infra_excess": json.dumps(action),
        "metrics.tensorboard": "false",
    }
    return load_config(SMOKE, overrides)


RUNS = [pytest.param("inline", 0, id="sync"), pytest.param("process", 1, id="pipeline-budget-1")]


@pytest.mark.parametrize("source,budget", RUNS)
def test_a_prompt_masked_often_is_flagged_and_scored_as_failures(tmp_path, judge_url, source, budget):
    cfg = _cfg(tmp_path, judge_url, budget, "fail")
    RunLoop(cfg, log=lambda *_: None, source=source).run()
    run = Path(cfg.run_dir)
    record = json.loads((run / "masking.json").read_text())
    assert ["broken"] == [f["key"] for f in record["flags"] if f["kind"] == "prompt"]
    assert record["prompts"]["broken"]["flagged"] and record["prompts"]["broken"]["masked"] >= 8
    assert record["scored_as_failures"] >= 4
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/infra_frac" in m]
    assert len(steps) == 4 and all(0.0 <= m["rollout/infra_frac"] <= 1.0 for m in steps)
    assert sum(m["rollout/infra_scored"] for m in steps) == record["scored_as_failures"]
    assert steps[-1]["rollout/infra_flagged_prompts"] == 1.0
    events = read_events(run / "groups.jsonl") if source == "process" else []
    if source == "process":
        check_ledger(events, 4, cfg.loop.prompts_per_step)
        trained = [e for e in events if e["event"] == "trained" and e["uid"] == "broken"]
        assert trained and all(s == EXCESS_STATUS for e in trained[1:] for s in e["statuses"])
        assert all(r == 0.0 for e in trained[1:] for r in e["rewards"])  # failures, not masked


@pytest.mark.parametrize("source,budget", RUNS)
def test_a_prompt_masked_often_stops_the_run_naming_it(tmp_path, judge_url, source, budget):
    cfg = _cfg(tmp_path, judge_url, budget, "stop")
    with pytest.raises(MaskingExcess, match=r"prompt broken: \d+ of \d+ rollouts masked"):
        RunLoop(cfg, log=lambda *_: None, source=source).run()
    record = json.loads((Path(cfg.run_dir) / "masking.json").read_text())
    assert [f["key"] for f in record["flags"]] == ["broken"] and record["scored_as_failures"] == 0
