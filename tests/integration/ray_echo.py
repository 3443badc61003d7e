"""An actor main for tests/integration/test_ray_placement.py: it runs inside a Ray actor placed by
RayPlacement (so it must be importable there: the test puts this directory on PYTHONPATH)."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EchoSpec:
    name: str
    trainer_pid: int
    inbox: Any
    outbox: Any
    stop: Any
    heartbeats: Any
    weights: Any
    cfg: Any = None  # a run's config: a 'generator' actor then starts as a replica does (its environment)


def echo_main(spec: EchoSpec) -> None:
    """Echo every inbox item to the outbox (a progress mark each); load every weight version it can and report
    ("loaded", version, torn) where torn means the tensors did not all hold the version's value."""
    spec.heartbeats.register(spec.name)
    spec.outbox.put(("pid", os.getpid()))
    version = -1

    def load(state: dict[str, torch.Tensor], v: int) -> None:
        torn = any(not bool((t.float() == float(v)).all()) for t in state.values())
        spec.outbox.put(("loaded", v, torn))

    while not spec.stop.is_set():
        spec.heartbeats.beat(spec.name)
        got = spec.weights.fetch_into(load, version)
        if got is not None:
            version = got
        try:
            item = spec.inbox.get(timeout=0.01)
        except queue.Empty:
            continue
        if item == "raise":
            raise RuntimeError("asked to raise")
        if isinstance(item, tuple) and item[0] == "hold_mb":  # grow until Ray's memory monitor kills this actor
            held = []
            for _ in range(item[1] // 100):
                chunk = bytearray(100 << 20)
                chunk[::4096] = b"\1" * len(chunk[::4096])  # touch every page: resident, not just reserved
                held.append(chunk)
                spec.heartbeats.beat(spec.name)
                time.sleep(0.05)
            spec.outbox.put(("held", len(held) * 100))
            continue
        spec.outbox.put(("echo", item))
        spec.heartbeats.progress(spec.name, f"echoed {item}")
