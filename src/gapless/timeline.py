"""Actor timeline: who was busy doing what, and when, so the idle bubbles between them show.

API (stable; the synchronous loop and the asynchronous pipeline both write through it):

    timeline = open_timeline(run_dir, "trainer", enabled=True)   # or Timeline(run_dir, "trainer")
    with timeline.span("train", step=3):                          # one busy interval
        ...
    timeline.instant("checkpoint", step=3)                        # one point in time
    timeline.close()
    export_chrome_trace(run_dir)                                  # -> run_dir/trace.json

Span names used across gapless: `generate`, `score`, `train`, `weight_push`, `eval`, and
`wait_*` for time spent blocked on another actor (`wait_rollouts`, `wait_weights`, ...).

Storage: each process appends to its own file `run_dir/timeline/<actor>-<pid>.jsonl`, one JSON
object per span or instant, flushed per line, so several processes (and a forked child, which
reopens under its own pid) never share a file and a crash loses only the span in flight.
A record is `{"actor", "name", "pid", "tid", "start", "end", "args"}`; `start` is `time.time()`
(seconds since the epoch, so processes on one host line up) and `end - start` is measured with
`time.perf_counter()` (monotonic, so a duration is never negative even if the clock steps).
Instants have `end == start` and `"instant": true`. Threads of one process share the file
under a lock and are told apart by `tid`.

Guaranteed: every record written is one complete line; durations are >= 0; spans of one thread
do not overlap unless the caller nests them (nesting is legal in the trace format, but the
report's Gantt chart draws nested spans on top of each other, so prefer not to).
Not guaranteed: clocks of different hosts agree (they line up only as well as NTP keeps them).

`NullTimeline` is the disabled variant: the same methods, doing nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

TIMELINE_DIR = "timeline"
TRACE_FILE = "trace.json"


class Timeline:
    """Appends the spans of one actor in this process to `run_dir/timeline/<actor>-<pid>.jsonl`."""

    def __init__(self, run_dir: str | Path, actor: str):
        if not actor or "/" in actor:
            raise ValueError(f"actor name {actor!r} must be non-empty and contain no '/'")
        self.dir = Path(run_dir) / TIMELINE_DIR
        self.actor = actor
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        self._pid = -1

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Record the time spent inside the `with` block as one busy interval named `name`."""
        start, t0 = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self._write(name, start, start + (time.perf_counter() - t0), args, instant=False)

    def add(self, name: str, start: float, end: float, **args: Any) -> None:
        """Record a busy interval measured by the caller (`time.time()` seconds), e.g. many short
        decode steps merged into one span."""
        self._write(name, start, max(start, end), args, instant=False)

    def instant(self, name: str, **args: Any) -> None:
        """Record one point in time (a weight swap landing, a checkpoint written)."""
        now = time.time()
        self._write(name, now, now, args, instant=True)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def _write(self, name: str, start: float, end: float, args: dict[str, Any], instant: bool) -> None:
        record = {
            "actor": self.actor,
            "name": name,
            "pid": os.getpid(),
            "tid": threading.get_ident(),
            "start": start,
            "end": end,
            "args": args,
        }
        if instant:
            record["instant"] = True
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self._file().write(line)
            self._fh.flush()

    def _file(self) -> TextIO:
        if self._fh is None or self._pid != os.getpid():  # first write, or we are a forked child
            self.dir.mkdir(parents=True, exist_ok=True)
            self._pid = os.getpid()
            self._fh = open(self.dir / f"{self.actor}-{self._pid}.jsonl", "a")
        return self._fh


class NullTimeline:
    """The disabled timeline: same API, records nothing, costs a function call."""

    actor = "disabled"

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        yield

    def add(self, name: str, start: float, end: float, **args: Any) -> None:
        pass

    def instant(self, name: str, **args: Any) -> None:
        pass

    def close(self) -> None:
        pass


class MergedSpans:
    """Turns a loop's per-iteration state ('generate', 'wait_weights', ...) into one span per
    run of equal states, so a busy loop of millisecond steps writes a handful of records."""

    def __init__(self, timeline: Timeline | NullTimeline):
        self.timeline = timeline
        self.state: str | None = None
        self.since = 0.0

    def mark(self, state: str) -> None:
        if state != self.state:
            now = time.time()
            if self.state is not None:
                self.timeline.add(self.state, self.since, now)
            self.state, self.since = state, now

    def close(self) -> None:
        self.mark("")
        self.state = None


def open_timeline(run_dir: str | Path, actor: str, enabled: bool = True) -> Timeline | NullTimeline:
    return Timeline(run_dir, actor) if enabled else NullTimeline()


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record under `run_dir/timeline/`, sorted by start time; [] when there is none.
    A torn last line (the process was killed mid-write) is skipped."""
    records = []
    for path in sorted((Path(run_dir) / TIMELINE_DIR).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(records, key=lambda r: (r["start"], r["end"]))


def export_chrome_trace(run_dir: str | Path) -> Path:
    """Write `run_dir/trace.json` in the Chrome trace event format (opens in ui.perfetto.dev and
    chrome://tracing): one trace process per actor, one thread per (OS process, thread) of it,
    complete events ("X") for spans and instant events ("i"); times in microseconds from the
    first record."""
    records = read_records(run_dir)
    origin = records[0]["start"] if records else 0.0
    actors = sorted({r["actor"] for r in records})
    pids = {actor: i + 1 for i, actor in enumerate(actors)}
    threads: dict[tuple[str, int, int], int] = {}
    events: list[dict[str, Any]] = []
    for actor in actors:
        events.append({"ph": "M", "name": "process_name", "pid": pids[actor], "tid": 0, "args": {"name": actor}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pids[actor], "tid": 0, "args": {"sort_index": pids[actor]}}
        )
    for r in records:
        key = (r["actor"], r["pid"], r["tid"])
        if key not in threads:
            threads[key] = tid = sum(k[0] == r["actor"] for k in threads) + 1
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pids[r["actor"]],
                    "tid": tid,
                    "args": {"name": f"{r['actor']} (pid {r['pid']})"},
                }
            )
        event = {
            "name": r["name"],
            "cat": r["actor"],
            "pid": pids[r["actor"]],
            "tid": threads[key],
            "ts": (r["start"] - origin) * 1e6,
            "args": r.get("args", {}),
        }
        if r.get("instant"):
            event.update(ph="i", s="t")
        else:
            event.update(ph="X", dur=max(r["end"] - r["start"], 0.0) * 1e6)
        events.append(event)
    path = Path(run_dir) / TRACE_FILE
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
