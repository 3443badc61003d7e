"""The report from run dirs written by the real writers (JsonlSink, Timeline), without a training
run: a synchronous-looking run, a pipelined-looking one (waits, staleness > 0, two env
processes) and an empty one must all render, the empty one as "no data"."""

import time
from pathlib import Path

import pytest

from gapless.metrics import JsonlSink
from gapless.report import RunNotFound, build_report
from gapless.report.charts import CHARTS, staleness_counts
from gapless.report.runs import load_run, load_runs
from gapless.timeline import Timeline


def _write_run(path: Path, stale: bool) -> None:
    path.mkdir(parents=True)
    sink = JsonlSink(path / "metrics.jsonl")
    sink.log(0, {"eval/pass@1": 0.1})
    for step in range(1, 4):
        metrics = {
            "rollout/reward_mean": 0.1 * step,
            "perf/trainer_idle_frac": 0.1 if stale else 0.7,
            "perf/generator_idle_frac": 0.05 if stale else 0.6,
            "staleness/max": 1.0 if stale else 0.0,
            "staleness/count_0": 4.0,
            "rollout/status_ok": 2.0,
            "rollout/status_timeout": 1.0,
            "sandbox/run_s_mean": 0.02,
            "sandbox/queue_s_p99": 0.001,
            "rollout/completion_len_mean": 7.0,
        }
        if stale:
            metrics["staleness/count_1"] = 4.0
            metrics["perf/peak_rss_mb"] = 1000.0 + step
        sink.log(step, metrics)
    sink.close()
    trainer, generator = Timeline(path, "trainer"), Timeline(path, "generator")
    for _ in range(2):
        with generator.span("generate"):
            time.sleep(0.002)
        with trainer.span("wait_rollouts" if stale else "train"):
            time.sleep(0.002)
    trainer.instant("checkpoint")
    if stale:  # a pipelined run with a masking watch that flagged one prompt
        from gapless.orchestrate.masking import MaskingWatch
        from gapless.types import Completion, Rollout

        watch = MaskingWatch(0.1, "fail")
        done = Completion([1], [2], [-0.1], [0], "stop", "x")
        for uid in ("a", "b", "c", "d"):
            watch.observe(uid, [Rollout(uid, done, 1.0, "ok") for _ in range(4)])
        watch.observe("prompt-7", [Rollout("prompt-7", done, 0.0, "infra_error") for _ in range(4)])
        watch.write(path / "masking.json")


def test_report_renders_sync_async_and_empty_runs(tmp_path):
    _write_run(tmp_path / "sync", stale=False)
    _write_run(tmp_path / "async", stale=True)
    (tmp_path / "empty").mkdir()
    page = build_report([tmp_path / "sync", tmp_path / "async", tmp_path / "empty"], tmp_path / "out")
    text = page.read_text()
    assert text.count('<img class="chart"') == len(CHARTS) and "data:image/png;base64," in text
    assert "<script" not in text and "http://" not in text
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {f"{c.slug}.png" for c in CHARTS}
    assert (tmp_path / "sync" / "trace.json").is_file() and not (tmp_path / "empty" / "trace.json").exists()
    assert "0.70" in text and "0.10" in text  # mean trainer idle of each run in the summary table
    assert "prompt prompt-7</td><td>4 / 4" in text and "4 scored as failures" in text  # the async run's flag
    assert "sync: no masking.json" in text and "0.200" in text  # masked share: 4 of 20
    assert "<td>1003</td>" in text  # the async run's peak memory (no summary.json: no estimate beside it)


def test_staleness_histogram_counts_rollouts(tmp_path):
    _write_run(tmp_path / "async", stale=True)
    assert staleness_counts(load_run(tmp_path / "async")) == {0: 12.0, 1: 12.0}


def test_runs_with_the_same_name_are_told_apart(tmp_path):
    for parent in ("a", "b"):
        (tmp_path / parent / "run").mkdir(parents=True)
    assert [r.name for r in load_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"])] == ["a/run", "b/run"]


def test_missing_run_dir_raises_before_writing(tmp_path):
    with pytest.raises(RunNotFound, match="does not exist"):
        build_report([tmp_path / "nope"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
