"""Live views of a run, both `MetricsSink`s: a plain line per step, or a rich panel in place.

Both show the same fields, each only once a step has logged it: step and ETA, mean reward,
held-out pass@1 (the last evaluated value is carried forward), generated tokens/s, trainer and
generator idle fractions, staleness (mean/max), sandbox queue latency p99, and step time.
`ProgressLine` writes to any stream (logs, CI, files); `RichLiveView` redraws one panel on a
terminal and lets other prints scroll above it. `live_view` picks one from `metrics.live`.
Neither view affects what is recorded: they only read the metrics they are given.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

NAN = float("nan")


class _Progress:
    """Remembers the last value of each key and estimates time to go from the steps seen so far."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.last: dict[str, float] = {}
        self._first: tuple[int, float] | None = None
        self.step = 0

    def update(self, step: int, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        self.step = step
        self.last.update(metrics)
        self._now = now

    def eta_s(self) -> float:
        if self._first is None or self.step <= self._first[0]:
            return NAN
        per_step = (self._now - self._first[1]) / (self.step - self._first[0])
        return per_step * max(self.total - self.step, 0)

    def fields(self) -> list[tuple[str, str]]:
        """(label, formatted value) pairs for everything known so far."""
        g = self.last.get
        out = [("step", f"{self.step}/{self.total}"), ("eta", _duration(self.eta_s()))]
        if "rollout/reward_mean" in self.last:
            out.append(("reward", f"{g('rollout/reward_mean'):.3f}"))
        out.append(("pass@1", f"{g('eval/pass@1', NAN):.3f}"))
        if "perf/gen_tokens_per_s" in self.last:
            out.append(("tok/s", f"{g('perf/gen_tokens_per_s'):.0f}"))
        if "perf/trainer_idle_frac" in self.last:
            out.append(("idle T/G", f"{g('perf/trainer_idle_frac'):.2f}/{g('perf/generator_idle_frac', NAN):.2f}"))
        if "staleness/max" in self.last:
            out.append(("stale", f"{g('staleness/mean', NAN):.1f}/{g('staleness/max'):.0f}"))
        if "sandbox/queue_s_p99" in self.last:
            out.append(("queue p99", f"{g('sandbox/queue_s_p99') * 1e3:.1f}ms"))
        if "perf/step_s" in self.last:
            out.append(("step time", f"{g('perf/step_s'):.2f}s"))
        return out


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


class ProgressLine:
    """One line per logged step, e.g. `step 12/60  eta 0m58s  reward 0.312  pass@1 0.140 ...`."""

    def __init__(self, total_steps: int, stream: TextIO | None = None):
        self.progress = _Progress(total_steps)
        self.stream = stream

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.progress.update(step, metrics)
        line = "  ".join(f"{label} {value}" for label, value in self.progress.fields())
        print(line, file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass


class RichLiveView:
    """A panel redrawn in place on the terminal: a progress bar and the latest fields."""

    def __init__(self, total_steps: int, console=None):
        from rich.console import Console

        self.progress = _Progress(total_steps)
        self.console = console or Console()
        self._live = None

    def _render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        fields = self.progress.fields()
        table.add_row(*(f"[dim]{label}[/dim]" for label, _ in fields))
        table.add_row(*(f"[bold]{value}[/bold]" for _, value in fields))
        bar = ProgressBar(total=max(self.progress.total, 1), completed=self.progress.step)
        return Panel(Group(bar, table), title="gapless train", expand=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from rich.live import Live

        self.progress.update(step, metrics)
        if self._live is None:  # started on the first step, so setup messages print normally
            self._live = Live(self._render(), console=self.console, auto_refresh=False, redirect_stdout=True)
            self._live.start()
        self._live.update(self._render(), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def live_view(mode: str, total_steps: int, stream: TextIO | None = None) -> ProgressLine | RichLiveView:
    """`mode` is metrics.live: 'rich', 'plain', or 'auto' (rich only when stdout is a terminal)."""
    stream_is_tty = (stream or sys.stdout).isatty()
    if mode == "rich" or (mode == "auto" and stream_is_tty):
        from rich.console import Console

        return RichLiveView(total_steps, Console(file=stream, force_terminal=mode == "rich" or None))
    return ProgressLine(total_steps, stream)
