"""Observability of a real short run: its report in headless Chromium, its TensorBoard events
read back by TensorBoard's own reader, and its Chrome trace."""

import json
import shutil
from pathlib import Path

import pytest
from cdp import HeadlessChromium, chromium_binary

from gapless.cli import main
from gapless.config import load_config
from gapless.orchestrate.loop import train
from gapless.report import build_report
from gapless.report.charts import CHARTS

CONFIGS = Path(__file__).parents[2] / "configs"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, warm_cache) -> Path:
    """Three real steps of the smoke job with every local sink on."""
    run = tmp_path_factory.mktemp("observed") / "run"
    cfg = load_config(
        CONFIGS / "smoke.toml",
        {
            "run_dir": json.dumps(str(run)),
            "warmstart.cache_dir": json.dumps(str(warm_cache)),
            "metrics.live": "plain",
            "metrics.tensorboard": "true",
            "metrics.timeline": "true",
        },
    )
    train(cfg, log=lambda *_: None)
    return run


def test_sync_loop_logs_idle_staleness_and_sandbox_latency(short_run):
    steps = [json.loads(line) for line in (short_run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "train/loss" in s]
    assert len(steps) == 3
    for s in steps:
        assert 0 <= s["perf/trainer_idle_frac"] <= 1 and 0 <= s["perf/generator_idle_frac"] <= 1
        assert s["staleness/mean"] == s["staleness/max"] == 0
        assert s["staleness/count_0"] == 2 * 4  # prompts_per_step * group_size, all fresh
        assert s["sandbox/run_s_mean"] > 0 and s["sandbox/run_s_max"] >= s["sandbox/run_s_mean"]
        assert s["time"] > 1e9


def test_chrome_trace_of_a_run(short_run):
    trace = json.loads((short_run / "trace.json").read_text())  # written at the end of the run
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    actors = {e["args"]["name"]: e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert set(actors) == {"generator", "env", "trainer"}
    names_by_actor = {a: {e["name"] for e in spans if e["pid"] == pid} for a, pid in actors.items()}
    # the pipeline's actors (budget 0): the generator decodes or waits for the next weights, the
    # environment scores, the trainer waits for rollouts, trains, pushes weights and evaluates
    assert (
        {"generate", "wait_weights"}
        <= names_by_actor["generator"]
        <= {"generate", "wait_weights", "weight_load", "wait_env_queue"}
    )
    assert names_by_actor["env"] == {"score"}
    assert (
        {"wait_rollouts", "train", "weight_push", "eval"}
        <= names_by_actor["trainer"]
        <= {"wait_actors_start", "wait_rollouts", "train", "weight_push", "eval"}
    )
    assert sum(e["name"] == "train" for e in spans) == 3
    assert all(e["dur"] > 0 for e in spans)
    by_thread: dict[tuple, list] = {}
    for e in spans:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(events, events[1:]))


def test_tensorboard_events_read_back(short_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(short_run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "rollout/reward_mean",
        "train/loss",
        "perf/trainer_idle_frac",
        "perf/generator_idle_frac",
        "staleness/max",
        "eval/pass@1",
    ):
        assert tag in tags, tag
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    logged = [json.loads(line) for line in (short_run / "metrics.jsonl").read_text().splitlines()]
    expected = [s["rollout/reward_mean"] for s in logged if "rollout/reward_mean" in s]
    assert [e.value for e in events.Scalars("rollout/reward_mean")] == pytest.approx(expected)


def test_report_renders_in_headless_chromium(short_run, tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's 'chromium')")
    empty = tmp_path / "older-run"  # a run dir with nothing in it: every chart says "no data" for it
    empty.mkdir()
    assert main(["report", str(short_run), str(empty), "--out", str(tmp_path / "report")]) == 0
    page = tmp_path / "report" / "report.html"
    assert "http://" not in page.read_text() and "https://" not in page.read_text()  # nothing fetched
    for chart in CHARTS:
        assert (tmp_path / "report" / f"{chart.slug}.png").stat().st_size > 1000
    browser = HeadlessChromium(binary)
    try:
        errors = browser.open(page.as_uri())
        images = browser.evaluate(
            "Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])"
        )
        title = browser.evaluate("document.title")
    finally:
        browser.close()
    assert errors == []
    assert [alt for alt, *_ in images] == [chart.title for chart in CHARTS]
    assert all(complete and width > 0 and height > 0 for _, complete, width, height in images), images
    assert "run" in title and "older-run" in title


def test_report_of_a_missing_run_dir_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "no-such-run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_report_defaults_to_the_first_run_dir(short_run):
    path = build_report([short_run])
    assert path == short_run / "report" / "report.html" and path.stat().st_size > 10_000
