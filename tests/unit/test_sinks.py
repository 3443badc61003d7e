"""Sinks chosen by config: live views (plain and rich), TensorBoard, W&B offline."""

import io
import json

import pytest

from gapless.config import ConfigError, load_config
from gapless.live import ProgressLine, RichLiveView, live_view
from gapless.metrics import JsonlSink, TensorBoardSink, open_sinks

STEP = {
    "rollout/reward_mean": 0.25,
    "perf/gen_tokens_per_s": 1234.0,
    "perf/trainer_idle_frac": 0.7,
    "perf/generator_idle_frac": 0.3,
    "staleness/mean": 0.5,
    "staleness/max": 1.0,
    "sandbox/queue_s_p99": 0.012,
    "perf/step_s": 1.5,
}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_line_shows_every_field_once_logged():
    out = io.StringIO()
    view = ProgressLine(10, out)
    view.log(0, {"eval/pass@1": 0.125})
    view.log(1, STEP)
    view.log(2, STEP)
    first, second, third = out.getvalue().splitlines()
    assert first.startswith("step 0/10") and "pass@1 0.125" in first and "reward" not in first
    for fragment in (
        "step 2/10",
        "eta 0m",
        "reward 0.250",
        "pass@1 0.125",
        "tok/s 1234",
        "idle T/G 0.70/0.30",
        "stale 0.5/1",
        "queue p99 12.0ms",
        "step time 1.50s",
    ):
        assert fragment in third, fragment


def test_rich_view_draws_a_panel_on_a_terminal():
    from rich.console import Console

    out = _Tty()
    view = RichLiveView(10, Console(file=out, force_terminal=True, width=120))
    view.log(1, STEP)
    view.log(2, {**STEP, "eval/pass@1": 0.5})
    view.close()
    text = out.getvalue()
    assert "gapless train" in text and "2/10" in text and "0.500" in text and "0.70/0.30" in text


def test_auto_picks_rich_on_a_terminal_and_plain_otherwise():
    assert isinstance(live_view("auto", 5, _Tty()), RichLiveView)
    assert isinstance(live_view("auto", 5, io.StringIO()), ProgressLine)
    assert isinstance(live_view("rich", 5, io.StringIO()), RichLiveView)
    assert isinstance(live_view("plain", 5, _Tty()), ProgressLine)


def test_open_sinks_follows_the_config(tmp_path):
    cfg = load_config(
        None, {"run_dir": json.dumps(str(tmp_path)), "metrics.tensorboard": "false", "metrics.live": "plain"}
    )
    out = io.StringIO()
    sinks = open_sinks(cfg, 3, stream=out)
    assert [type(s) for s in sinks.sinks] == [JsonlSink, ProgressLine]
    sinks.log(1, STEP)
    sinks.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["step"] == 1 and record["rollout/reward_mean"] == 0.25 and "time" in record
    assert "reward 0.250" in out.getvalue()
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_sink_writes_scalars_tensorboard_reads(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for step in (1, 2):
        sink.log(step, {"train/loss": step / 10, "eval/pass@1": 0.5})
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [(1, 0.1), (2, 0.2)]
    assert [e.value for e in events.Scalars("eval/pass@1")] == [0.5, 0.5]


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional and not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        None,
        {
            "run_dir": json.dumps(str(tmp_path / "run")),
            "metrics.wandb_project": "'gapless-test'",
            "metrics.tensorboard": "false",
            "metrics.live": "plain",
        },
    )
    sinks = open_sinks(cfg, 2, stream=io.StringIO())
    sinks.log(1, {"train/loss": 0.5})
    sinks.close()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_wandb_configured_but_missing_is_a_config_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_config(
        None,
        {
            "run_dir": json.dumps(str(tmp_path)),
            "metrics.wandb_project": "'p'",
            "metrics.live": "plain",
            "metrics.tensorboard": "false",
        },
    )
    with pytest.raises(ConfigError, match="pip install wandb"):
        open_sinks(cfg, 2)
