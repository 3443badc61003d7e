"""The report's charts: each takes the runs and returns one matplotlib figure comparing them.

Every run keeps one colour across all charts. A panel whose data is absent in every run shows
"no data" instead of raising, so a report of a partial or older run still renders. Idle
fractions and the Gantt chart (gantt.py) are the charts that show the gap: a trainer that waits
on the generator has an idle fraction near 1 and white bubbles between its spans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from gapless.report.gantt import gantt_figure  # noqa: E402
from gapless.report.runs import Run  # noqa: E402

COLOURS = plt.get_cmap("tab10").colors


def colour(i: int) -> tuple[float, float, float]:
    return COLOURS[i % len(COLOURS)]


def no_data(ax: Axes, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="0.5")
    ax.set_xticks([])
    ax.set_yticks([])


def _lines(
    ax: Axes,
    runs: list[Run],
    key: str,
    x: str,
    ylabel: str,
    scale: float = 1.0,
    style: str = "-",
    label_suffix: str = "",
) -> bool:
    """One line per run of `key` against steps (x='step') or wall seconds (x='wall')."""
    drawn = False
    for i, run in enumerate(runs):
        steps, walls, values = run.series(key)
        if values:
            xs = steps if x == "step" else walls
            ax.plot(
                xs,
                [v * scale for v in values],
                style,
                color=colour(i),
                marker="o" if len(xs) < 30 else None,
                markersize=3,
                label=run.name + label_suffix,
            )
            drawn = True
    ax.set_xlabel("step" if x == "step" else "wall time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return drawn


def _two_panels(runs: list[Run], panels: tuple[tuple[str, str, str], tuple[str, str, str]]) -> Figure:
    """Side by side, one (metric key, x axis, y label) per panel."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, (key, x, ylabel) in zip(axes, panels):
        if _lines(ax, runs, key, x, ylabel):
            ax.legend(fontsize=8)
        else:
            no_data(ax)
    fig.tight_layout()
    return fig


def reward_chart(runs: list[Run]) -> Figure:
    key, label = "rollout/reward_mean", "mean reward"
    return _two_panels(runs, ((key, "step", label), (key, "wall", label)))


def pass_chart(runs: list[Run]) -> Figure:
    key, label = "eval/pass@1", "held-out pass@1"
    return _two_panels(runs, ((key, "step", label), (key, "wall", label)))


def length_chart(runs: list[Run]) -> Figure:
    return _two_panels(
        runs,
        (
            ("rollout/completion_len_mean", "step", "completion length (tokens)"),
            ("rollout/truncated_frac", "step", "truncated fraction"),
        ),
    )


def idle_chart(runs: list[Run]) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, actor in zip(axes, ("trainer", "generator")):
        key = f"perf/{actor}_idle_frac"
        drawn = False
        for i, run in enumerate(runs):
            _, walls, values = run.series(key)
            if values:
                ax.plot(
                    walls,
                    values,
                    color=colour(i),
                    marker="o" if len(values) < 30 else None,
                    markersize=3,
                    label=f"{run.name} (mean {sum(values) / len(values):.2f})",
                )
                drawn = True
        ax.set_title(f"{actor} idle fraction", fontsize=10)
        ax.set_xlabel("wall time (s)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8) if drawn else no_data(ax)
    fig.tight_layout()
    return fig


def staleness_counts(run: Run) -> dict[int, float]:
    """Rollouts per staleness value: from `staleness/count_<k>` when logged, else per-step maxima."""
    counts: dict[int, float] = {}
    for key in run.keys("staleness/count_"):
        counts[int(key.rsplit("_", 1)[1])] = run.total(key)
    if not counts:
        for value in run.series("staleness/max")[2]:
            counts[int(value)] = counts.get(int(value), 0) + 1
    return counts


def staleness_chart(runs: list[Run]) -> Figure:
    fig, ax = plt.subplots(figsize=(11, 3.2))
    per_run = [staleness_counts(run) for run in runs]
    width = 0.8 / max(len(runs), 1)
    for i, (run, counts) in enumerate(zip(runs, per_run)):
        total = sum(counts.values()) or 1
        ks = sorted(counts)
        ax.bar(
            [k + (i - (len(runs) - 1) / 2) * width for k in ks],
            [counts[k] / total for k in ks],
            width,
            color=colour(i),
            label=run.name,
        )
    if any(per_run):
        ax.set_xlabel("staleness (trainer version - oldest sampling version)")
        ax.set_ylabel("fraction of rollouts")
        ax.set_xticks(sorted({k for c in per_run for k in c}))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    else:
        no_data(ax)
    fig.tight_layout()
    return fig


def sandbox_latency_chart(runs: list[Run]) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    drawn = _lines(axes[0], runs, "sandbox/run_s_mean", "step", "sandbox run (ms)", 1e3, "-", " mean")
    drawn |= _lines(axes[0], runs, "sandbox/run_s_p99", "step", "sandbox run (ms)", 1e3, "--", " p99")
    axes[0].set_title("run latency", fontsize=10)
    axes[0].legend(fontsize=8) if drawn else no_data(axes[0])
    drawn = _lines(axes[1], runs, "sandbox/queue_s_p50", "step", "sandbox queue (ms)", 1e3, "-", " p50")
    drawn |= _lines(axes[1], runs, "sandbox/queue_s_p99", "step", "sandbox queue (ms)", 1e3, "--", " p99")
    axes[1].set_title("queue wait", fontsize=10)
    axes[1].legend(fontsize=8) if drawn else no_data(axes[1])
    fig.tight_layout()
    return fig


def status_chart(runs: list[Run]) -> Figure:
    fig, ax = plt.subplots(figsize=(11, 3.4))
    statuses = sorted({k.removeprefix("rollout/status_") for run in runs for k in run.keys("rollout/status_")})
    if not statuses:
        no_data(ax)
        return fig
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        totals = [run.total(f"rollout/status_{s}") for s in statuses]
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(statuses))]
        ax.bar(xs, totals, width, color=colour(i), label=run.name)
    ax.set_xticks(range(len(statuses)), statuses, rotation=15, fontsize=9)
    ax.set_ylabel("rollouts (whole run)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def masking_chart(runs: list[Run]) -> Figure:
    return _two_panels(
        runs,
        (
            ("rollout/infra_frac", "step", "masked share of the step's rollouts"),
            ("rollout/infra_frac_run", "step", "masked share of the run so far"),
        ),
    )


@dataclass(frozen=True)
class Chart:
    slug: str  # the PNG's file name
    title: str
    caption: str
    draw: Callable[[list[Run]], Figure]


CHARTS = [
    Chart("reward", "Reward", "Mean rollout reward per step, against steps and against wall time.", reward_chart),
    Chart("pass_at_1", "Held-out pass@1", "Greedy pass@1 on the held-out split whenever it was evaluated.", pass_chart),
    Chart(
        "idle",
        "Idle fractions",
        "Share of each step's wall time the trainer (left) and the generator (right) "
        "spent not doing their own work. A synchronous loop keeps both high; a pipeline should push them to 0.",
        idle_chart,
    ),
    Chart(
        "timeline",
        "Actor timeline",
        "Busy spans of each actor per run (hatched grey: waiting; white: idle "
        "bubbles). Time from each run's first span.",
        gantt_figure,
    ),
    Chart(
        "staleness",
        "Staleness",
        "Rollouts by staleness at consume time (0 everywhere in a synchronous run).",
        staleness_chart,
    ),
    Chart("length", "Response length", "Mean completion length and the fraction cut at max_new_tokens.", length_chart),
    Chart(
        "sandbox_latency", "Sandbox latency", "Sandbox run time and queue wait per step (ms).", sandbox_latency_chart
    ),
    Chart("sandbox_status", "Rollout statuses", "Rollouts by status over the whole run.", status_chart),
    Chart(
        "masking",
        "Masked rollouts",
        "Share of rollouts that came back infra_error (masked from GRPO) per step and "
        "over the run; the prompts and policy versions flagged as masked far above the run's rate are listed below.",
        masking_chart,
    ),
]
