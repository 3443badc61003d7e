"""The run's resident memory: each process's own peak (VmHWM), summed over the trainer's process tree.

`perf/peak_rss_mb` is what the memory estimate printed at start (memory_fit.py) is checked
against: the trainer process and every live process it started (the generator, environment
actors, sandbox slots), each at its own high-water mark. A sum of peaks bounds the tree's
peak from above (two processes may peak at different moments), which is the side an estimate
that must not be passed is compared on. `perf/trainer_peak_rss_mb` is the trainer's alone.

Not guaranteed: a process that has already exited is not counted (its peak is gone from
/proc), and outside Linux both figures are 0.
"""

from __future__ import annotations

import os
from pathlib import Path

MB = 1 << 20


def peak_rss_metrics() -> dict[str, float]:
    own = _hwm_bytes(os.getpid())
    tree = own + sum(_hwm_bytes(pid) for pid in _descendants(os.getpid()))
    return {"perf/peak_rss_mb": tree / MB, "perf/trainer_peak_rss_mb": own / MB}


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid`, through /proc/<pid>/task/<tid>/children."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in _listdir(Path(f"/proc/{parent}/task")):
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _hwm_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0
