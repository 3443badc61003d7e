"""The actor timeline as a Gantt chart: one panel per run, one lane per actor thread.

Busy spans are coloured by name (generate, score, train, weight_push, eval); `wait_*` spans are
hatched grey; time with no span is white, so an idle bubble is literally a gap in a lane. Each
run's time axis starts at its own first span, so runs of different lengths sit side by side on
comparable scales (each panel has its own x-axis). A run without timeline files shows
"no data".
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from gapless.report.runs import Run  # noqa: E402

SPAN_COLOURS = {
    "generate": "#1f77b4",
    "score": "#ff7f0e",
    "train": "#2ca02c",
    "weight_push": "#d62728",
    "eval": "#9467bd",
}
OTHER = "#8c564b"
WAIT = "#d9d9d9"
ACTOR_ORDER = {"generator": 0, "env": 1, "trainer": 2}


def _lanes(spans: list[dict]) -> list[tuple[str, int, int]]:
    """(actor, pid, tid) lanes ordered generator, env, trainer, then the rest by name."""
    keys = {(s["actor"], s["pid"], s["tid"]) for s in spans}
    return sorted(keys, key=lambda k: (ACTOR_ORDER.get(k[0], 9), k[0], k[1], k[2]))


def _lane_labels(lanes: list[tuple[str, int, int]]) -> list[str]:
    per_actor: dict[str, int] = {}
    for actor, _, _ in lanes:
        per_actor[actor] = per_actor.get(actor, 0) + 1
    seen: dict[str, int] = {}
    labels = []
    for actor, _, _ in lanes:
        seen[actor] = seen.get(actor, 0) + 1
        labels.append(actor if per_actor[actor] == 1 else f"{actor} #{seen[actor]}")
    return labels


def draw_run(ax, run: Run) -> set[str]:
    """Draw one run's lanes on `ax`; returns the span names drawn (for the legend)."""
    spans = [s for s in run.spans if not s.get("instant")]
    if not spans:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, fontsize=12, color="0.5")
        ax.set_xticks([])
        ax.set_yticks([])
        return set()
    origin = min(s["start"] for s in run.spans)
    lanes = _lanes(spans)
    row = {lane: i for i, lane in enumerate(lanes)}
    names: set[str] = set()
    by_lane_name: dict[tuple, list[tuple[float, float]]] = {}
    for s in spans:
        key = (row[(s["actor"], s["pid"], s["tid"])], s["name"])
        by_lane_name.setdefault(key, []).append((s["start"] - origin, max(s["end"] - s["start"], 0.0)))
    for (i, name), bars in by_lane_name.items():
        is_wait = name.startswith("wait")
        ax.broken_barh(
            bars,
            (i - 0.38, 0.76),
            facecolors=WAIT if is_wait else SPAN_COLOURS.get(name, OTHER),
            hatch="///" if is_wait else None,
            edgecolor="0.6" if is_wait else "none",
            linewidth=0,
        )
        names.add("wait_*" if is_wait else name)
    for s in run.spans:
        if s.get("instant") and (s["actor"], s["pid"], s["tid"]) in row:
            i = row[(s["actor"], s["pid"], s["tid"])]
            ax.plot([s["start"] - origin] * 2, [i - 0.45, i + 0.45], color="black", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), _lane_labels(lanes))
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, max(s["end"] for s in run.spans) - origin)
    ax.set_xlabel("wall time since first span (s)")
    ax.grid(alpha=0.3, axis="x")
    return names


def gantt_figure(runs: list[Run]) -> Figure:
    heights = [max(len(_lanes([s for s in run.spans if not s.get("instant")])), 1) * 0.45 + 1.1 for run in runs]
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(11, sum(heights) + 0.6), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    names: set[str] = set()
    for ax, run in zip(axes[:, 0], runs):
        names |= draw_run(ax, run)
        ax.set_title(run.name, fontsize=10, loc="left")
    if names:
        order = [n for n in (*SPAN_COLOURS, "wait_*") if n in names] + sorted(names - {*SPAN_COLOURS, "wait_*"})
        handles = [
            Patch(facecolor=WAIT, hatch="///", edgecolor="0.6", label=n)
            if n == "wait_*"
            else Patch(color=SPAN_COLOURS.get(n, OTHER), label=n)
            for n in order
        ]
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if names else 1))
    return fig
