"""`gapless report RUN_DIR [RUN_DIR ...]`: one self-contained HTML page comparing runs.

`build_report(run_dirs, out_dir)` writes `out_dir/report.html` and one PNG per chart
(`charts.CHARTS`), and a Chrome trace `RUN_DIR/trace.json` for each run that has a timeline.
A last section lists, per run, the prompts and policy versions flagged for masking far above the
run's rate (masking.json) and its most masked prompts. The page needs no network: every chart is embedded as a base64 PNG, the style sheet is inline,
and there is no script. Missing data becomes a "no data" panel; a run directory that does not
exist raises `RunNotFound` before anything is written.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

from gapless.report.runs import Run, RunNotFound, load_runs

__all__ = ["build_report", "RunNotFound"]

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.8em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; margin: 0.3em 0 0.6em; }
code { background: #f4f4f4; padding: 0 0.2em; }
"""

SUMMARY_ROWS = [
    ("steps", lambda r: len(r.series("rollout/reward_mean")[2]), "{:.0f}"),
    ("pass@1 start", lambda r: r.summary.get("eval/pass@1_start", _first(r, "eval/pass@1")), "{:.3f}"),
    ("pass@1 end", lambda r: r.summary.get("eval/pass@1_end", _last(r, "eval/pass@1")), "{:.3f}"),
    ("RL wall time (s)", lambda r: r.summary.get("rl_wall_s", float("nan")), "{:.1f}"),
    ("mean reward", lambda r: r.mean("rollout/reward_mean"), "{:.3f}"),
    ("trainer idle (mean)", lambda r: r.mean("perf/trainer_idle_frac"), "{:.2f}"),
    ("generator idle (mean)", lambda r: r.mean("perf/generator_idle_frac"), "{:.2f}"),
    ("staleness max", lambda r: max(r.series("staleness/max")[2], default=float("nan")), "{:.0f}"),
    ("generated tokens/s (mean)", lambda r: r.mean("perf/gen_tokens_per_s"), "{:.0f}"),
    ("peak memory, MB (estimate at start)", lambda r: _peak_memory(r), "{}"),
    ("timeline spans", lambda r: len(r.spans), "{:.0f}"),
    ("masked share (infra_error)", lambda r: _masked_share(r), "{:.3f}"),
    (
        "masking flags (prompts, versions)",
        lambda r: len(r.masking["flags"]) if "flags" in r.masking else float("nan"),
        "{:.0f}",
    ),
]
TOP_PROMPTS = 10  # most masked prompts listed per run


def _masked_share(run: Run) -> float:
    if run.masking.get("rollouts"):
        return run.masking["masked"] / run.masking["rollouts"]
    return _last(run, "rollout/infra_frac_run")


def masking_section(runs: list[Run]) -> str:
    """Per run: its flags with their evidence and its most masked prompts (masking.json)."""
    parts = []
    for run in runs:
        m = run.masking
        if not m:
            parts.append(f"<p>{html.escape(run.name)}: no masking.json.</p>")
            continue
        flags = "".join(
            f"<tr><td>{html.escape(f['kind'])} {html.escape(str(f['key']))}</td><td>{f['masked']} / "
            f"{f['rollouts']}</td><td>{f['base_rate']:.3f}</td><td>{f['p_value']:.1e}</td></tr>"
            for f in m.get("flags", [])
        )
        prompts = sorted(m.get("prompts", {}).items(), key=lambda kv: -kv[1]["masked"] / max(kv[1]["rollouts"], 1))
        top = "".join(
            f"<tr><td>{html.escape(uid)}</td><td>{c['masked']} / {c['rollouts']}</td>"
            f"<td>{'flagged' if c.get('flagged') else ''}</td></tr>"
            for uid, c in prompts[:TOP_PROMPTS]
        )
        parts.append(
            f"<h3>{html.escape(run.name)}</h3><p>{m.get('masked', 0)} of {m.get('rollouts', 0)} rollouts masked; "
            f"{m.get('scored_as_failures', 0)} scored as failures (pipeline.on_infra_excess = "
            f"'{html.escape(str(m.get('on_infra_excess')))}', max_infra_fraction {m.get('max_infra_fraction')}).</p>"
            + (
                f"<table><tr><th>flagged</th><th>masked / rollouts</th><th>rest of run's rate</th><th>binomial tail</th>"
                f"</tr>{flags}</table>"
                if flags
                else "<p>No prompt or policy version flagged.</p>"
            )
            + (
                f"<table><tr><th>most masked prompts</th><th>masked / rollouts</th><th></th></tr>{top}</table>"
                if top
                else ""
            )
        )
    return '<h2 id="masking_flags">Masking: flagged prompts and versions</h2>' + "".join(parts)


def _first(run: Run, key: str) -> float:
    values = run.series(key)[2]
    return values[0] if values else float("nan")


def _peak_memory(run: Run) -> str | float:
    """The run's peak RSS (process tree, summed per-process peaks) beside the start's estimate."""
    peak = run.summary.get("perf/peak_rss_mb", max(run.series("perf/peak_rss_mb")[2], default=float("nan")))
    if math.isnan(peak):
        return peak
    estimate = run.summary.get("memory_estimate_mb")
    return f"{peak:.0f}" + (f" ({estimate:.0f})" if estimate is not None else "")


def _last(run: Run, key: str) -> float:
    values = run.series(key)[2]
    return values[-1] if values else float("nan")


def _cell(fmt: str, value: float) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _summary_table(runs: list[Run]) -> str:
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    rows = "".join(
        f"<tr><td>{label}</td>" + "".join(f"<td>{_cell(fmt, get(r))}</td>" for r in runs) + "</tr>"
        for label, get, fmt in SUMMARY_ROWS
    )
    return f"<table><tr><th></th>{head}</tr>{rows}</table>"


def build_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> Path:
    """Write the report for `run_dirs` into `out_dir` (default: FIRST_RUN_DIR/report); returns
    the path of report.html."""
    import matplotlib.pyplot as plt

    from gapless.report.charts import CHARTS
    from gapless.timeline import export_chrome_trace

    runs = load_runs(list(run_dirs))
    out = Path(out_dir) if out_dir is not None else runs[0].path / "report"
    out.mkdir(parents=True, exist_ok=True)
    traces = []
    for run in runs:
        if run.spans:
            trace = export_chrome_trace(run.path)
            traces.append(
                f"<li>{html.escape(run.name)}: <code>{html.escape(trace.name)}</code> in its run directory</li>"
            )
    sections = []
    for chart in CHARTS:
        fig = chart.draw(runs)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        png = buf.getvalue()
        (out / f"{chart.slug}.png").write_bytes(png)
        data = base64.b64encode(png).decode()
        sections.append(
            f'<h2 id="{chart.slug}">{html.escape(chart.title)}</h2><figure>'
            f'<img class="chart" alt="{html.escape(chart.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(chart.caption)}</figcaption></figure>"
        )
    names = ", ".join(html.escape(r.name) for r in runs)
    trace_note = (
        (
            f"<p>Chrome traces (open in <code>ui.perfetto.dev</code> or <code>chrome://tracing</code>):</p>"
            f"<ul>{''.join(traces)}</ul>"
        )
        if traces
        else ""
    )
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>gapless report: {names}</title>'
        f"<style>{STYLE}</style></head><body><h1>gapless report: {names}</h1>"
        f"<h2>Summary</h2>{_summary_table(runs)}{''.join(sections)}{masking_section(runs)}{trace_note}"
        "</body></html>"
    )
    path = out / "report.html"
    path.write_text(page)
    return path
