"""Read a run directory into plain series for the report; every file is optional.

A run directory may hold `metrics.jsonl` (one object per logged step, written by
`metrics.JsonlSink`), `summary.json`, `config.json`, `masking.json` (`orchestrate/masking.py`) and
`timeline/*.jsonl` (`timeline.py`).
Whatever is missing or empty reads as empty, so a chart can say "no data" instead of failing;
only a directory that does not exist is an error (`RunNotFound`). Works for any run that writes
these files, whichever loop (synchronous or pipelined) produced it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gapless.timeline import read_records


class RunNotFound(FileNotFoundError):
    pass


@dataclass
class Run:
    name: str
    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    spans: list[dict[str, Any]] = field(default_factory=list)
    masking: dict[str, Any] = field(default_factory=dict)  # masking.json (orchestrate/masking.py)

    def series(self, key: str) -> tuple[list[float], list[float], list[float]]:
        """(steps, wall seconds since the first record, values) of every record that has `key`."""
        t0 = next((r["time"] for r in self.records if "time" in r), None)
        steps, walls, values = [], [], []
        for i, r in enumerate(self.records):
            if key in r and r[key] is not None:
                steps.append(r["step"])
                walls.append(r["time"] - t0 if t0 is not None and "time" in r else float(i))
                values.append(float(r[key]))
        return steps, walls, values

    def keys(self, prefix: str) -> list[str]:
        return sorted({k for r in self.records for k in r if k.startswith(prefix)})

    def total(self, key: str) -> float:
        return sum(self.series(key)[2])

    def mean(self, key: str) -> float:
        values = self.series(key)[2]
        return sum(values) / len(values) if values else float("nan")


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    return out


def load_run(path: str | Path, name: str | None = None) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise RunNotFound(f"run directory {str(path)!r} does not exist")
    return Run(
        name or path.name,
        path,
        _jsonl(path / "metrics.jsonl"),
        _json(path / "summary.json"),
        _json(path / "config.json"),
        read_records(path),
        _json(path / "masking.json"),
    )


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Runs named by their directory; clashing names get their parent prepended."""
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    if len(set(names)) < len(names):
        names = [f"{n} ({i + 1})" for i, n in enumerate(names)]
    return [load_run(p, n) for p, n in zip(paths, names)]
