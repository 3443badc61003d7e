"""Metrics sinks: every step's namespaced scalars go to each sink; call sites never branch.

`open_sinks(cfg, total_steps)` builds the run's sinks from `[metrics]` in the config:
`JsonlSink` (always: `metrics.jsonl`, one JSON object per step with `step` and `time`, the
wall-clock `time.time()` of the log call, flushed each line so a crash loses nothing already
logged), the live view (`live.py`: a rich panel on a terminal, a plain line otherwise),
`TensorBoardSink` (`RUN_DIR/tensorboard`) and `WandbSink` (only when `metrics.wandb_project` is
set; `wandb` is an optional package). The loop logs through `Sinks` and never asks which are on.

Keys are namespaced: `rollout/*`, `eval/*`, `train/*`, `perf/*`, `staleness/*`, `sandbox/*`.
Values must be finite-or-NaN floats; sinks do not validate them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from gapless.live import ProgressLine, RichLiveView, live_view

if TYPE_CHECKING:
    from gapless.config import Config

__all__ = [
    "MetricsSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "ProgressLine",
    "RichLiveView",
    "Sinks",
    "open_sinks",
]


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path, append: bool = False):
        self._fh = open(path, "a" if append else "w")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardSink:
    """Scalars to TensorBoard event files under `log_dir` (one tag per metric key)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars to a Weights & Biases run; 'offline' mode writes under `run_dir/wandb`, no network."""

    def __init__(self, project: str, mode: str, run_dir: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            from gapless.config import ConfigError

            raise ConfigError(
                "metrics.wandb_project is set but the wandb package is not installed; "
                "pip install wandb, or unset metrics.wandb_project"
            ) from None
        self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), config=config, name=run_dir.name)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(cfg: Config, total_steps: int, append: bool = False, stream: TextIO | None = None) -> Sinks:
    """The run's sinks as `cfg.metrics` asks; `append` continues the files of a resumed run."""
    run_dir, m = Path(cfg.run_dir), cfg.metrics
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", append=append)]
    if m.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if m.wandb_project:
        sinks.append(WandbSink(m.wandb_project, m.wandb_mode, run_dir, cfg.model_dump(mode="json")))
    sinks.append(live_view(m.live, total_steps, stream or sys.stdout))
    return Sinks(sinks)
