"""Metrics sinks: every step's namespaced scalars go to each sink; call sites never branch.

`JsonlSink` appends one JSON object per step to `metrics.jsonl` (flushed each line, so a crash
loses nothing already logged). `ProgressLine` prints the live one-line summary. Keys are
namespaced: `rollout/*`, `eval/*`, `train/*`, `perf/*`, `sandbox/*`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Protocol, TextIO


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path, append: bool = False):
        self._fh = open(path, "a" if append else "w")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._fh.write(json.dumps({"step": step, **metrics}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class ProgressLine:
    """One line per step: step, reward, held-out pass@1, tokens/s, step time."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stdout):
        self.total = total_steps
        self.stream = stream
        self.last_pass = float("nan")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.last_pass = metrics.get("eval/pass@1", self.last_pass)
        if "rollout/reward_mean" not in metrics:
            print(f"step {step:>4}/{self.total}  held-out pass@1 {self.last_pass:.3f}", file=self.stream, flush=True)
            return
        line = (
            f"step {step:>4}/{self.total}  reward {metrics.get('rollout/reward_mean', float('nan')):.3f}  "
            f"pass@1 {self.last_pass:.3f}  tok/s {metrics.get('perf/gen_tokens_per_s', 0):>7.0f}  "
            f"step {metrics.get('perf/step_s', 0):.2f}s"
        )
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class Sinks:
    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
