"""Write a simulated run as a run directory, so `gapless report` draws it like a real one.

    RUN_DIR/metrics.jsonl     one record per step, with the pipeline's keys (perf/step_s,
                              perf/trainer_idle_frac, perf/generator_idle_frac, staleness/*,
                              drops/<reason>_total, rollout/*), `time` on the simulated clock
    RUN_DIR/timeline/*.jsonl  the actors' spans in the timeline format (timeline.py): one file
                              per actor, pid = replica, so the Gantt chart has one lane each
    RUN_DIR/groups.jsonl      the real ledger (orchestrate/ledger.py), written by the real buffer
    RUN_DIR/summary.json      the simulation's summary; RUN_DIR/config.json the resolved config
    RUN_DIR/costs.json        the cost model it ran with

The simulated clock starts at `EPOCH` (a fixed date), so simulated runs never pass for real ones
by their timestamps, and two simulations of the same config write identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from gapless.simulate.costs import Costs
from gapless.simulate.run import SimResult
from gapless.timeline import TIMELINE_DIR

EPOCH = 946684800.0  # 2000-01-01 UTC


def step_metrics(result: SimResult, prompt_tokens: int) -> list[dict]:
    out = []
    for r in result.steps:
        rollouts = max(sum(r.staleness.values()), 1)
        record = {
            "step": r.step, "time": EPOCH + r.end_s,
            "perf/step_s": r.step_s, "perf/train_s": r.train_s, "perf/weight_push_s": r.push_s,
            "perf/trainer_idle_frac": r.waited_s / max(r.step_s, 1e-12),
            "perf/generator_idle_frac": r.generator_idle_frac,
            "perf/gen_tokens_per_s": r.gen_tokens_per_s,
            "perf/trained_tokens_per_s": r.trained_tokens / max(r.train_s, 1e-12),
            "staleness/mean": sum(k * n for k, n in r.staleness.items()) / rollouts,
            "staleness/max": float(max(r.staleness, default=0)),
            **{f"staleness/count_{k}": float(v) for k, v in sorted(r.staleness.items())},
            "rollout/reward_mean": r.reward_mean,
            "rollout/completion_len_mean": r.length_mean,
            "rollout/prompt_len_mean": float(prompt_tokens),
            "rollout/truncated_frac": r.truncated_frac,
            "generator/partial_cuts": float(r.partial_cuts),
            **{f"drops/{k}_total": float(v) for k, v in sorted(r.drops.items())},
        }  # fmt: skip
        out.append(record)
    return out


def write_run(result: SimResult, run_dir: Path, config: dict, costs: Costs) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for record in step_metrics(result, costs.prompt_tokens):
            fh.write(json.dumps(record) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"simulated": True, **result.summary()}, indent=2))
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    (run_dir / "costs.json").write_text(costs.to_json())
    write_timeline(result, run_dir)


def write_timeline(result: SimResult, run_dir: Path) -> None:
    folder = run_dir / TIMELINE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.jsonl"):
        old.unlink()
    for lane, spans in result.spans.items():
        actor, _, number = lane.partition("-")
        pid = int(number) if number else 0
        with open(folder / f"{actor}-{pid}.jsonl", "w") as fh:
            for name, start, end in spans:
                if end > start:
                    fh.write(
                        json.dumps(
                            {
                                "actor": actor,
                                "name": name,
                                "pid": pid,
                                "tid": 0,
                                "start": EPOCH + start,
                                "end": EPOCH + end,
                                "args": {},
                            }
                        )
                        + "\n"
                    )
