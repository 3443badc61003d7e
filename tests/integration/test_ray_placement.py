"""Ray placement (cluster/ray/placement.py), on a private Ray instance started by the test.

The one Ray test of the fast suite drives RayPlacement's pieces through a real placed actor:
channels FIFO both ways, heartbeats and the actor's pid seen by the trainer, weight versions
that arrive monotonic and never torn (each version fills every tensor with its number, bf16
included), a kill -9 reported by `exited`, and a shutdown that leaves no Ray process behind.
The pipeline over Ray (bitwise equal to local at budget 0 on a multi-node cluster, infeasible
placements, a lost replica) is in test_ray_cluster.py (slow).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from gapless.config import load_config  # noqa: E402
from gapless.cluster import make_placement
from gapless.cluster.placement import Placement  # noqa: E402

from ray_echo import EchoSpec, echo_main  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "configs"
HERE = Path(__file__).parent


def ray_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a Ray instance's temporary directory)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if marker in line and "ps -eo" not in line]


def _get(channel, kind: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        item = channel.get(timeout=deadline - time.monotonic())
        if item[0] == kind:
            return item
    raise AssertionError(f"no {kind!r} message within {timeout_s} s")


def test_a_placed_actor_gets_fifo_messages_and_untorn_weights_and_leaves_nothing(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cfg = load_config(CONFIGS / "smoke.toml", {"cluster.placement": '"ray"', "pipeline.generator_threads": "1",
                                               "cluster.object_store_mb": "100"})
    placement = make_placement(cfg)
    temp_dir = placement.temp_dir
    try:
        assert isinstance(placement, Placement) and placement.kind == "ray"
        placement.reserve({"generator": 1})
        state = {"w": torch.zeros(3000), "b": torch.zeros(7, 5, dtype=torch.bfloat16), "i": torch.zeros(4, dtype=torch.int64)}
        stop, beats = placement.stop_flag(), placement.heartbeats(("trainer", "generator"))
        inbox, outbox = placement.channel(), placement.channel(8)
        spec = EchoSpec("generator", os.getpid(), inbox, outbox, stop, beats, placement.weights(state, 0))
        placement.start("generator", echo_main, spec)
        _, pid = _get(outbox, "pid", 120)
        assert _get(outbox, "loaded") == ("loaded", 0, False)
        for v in range(1, 11):  # faster than the relay: versions may be skipped, never torn or reordered
            spec.weights.publish({k: torch.full_like(t, v) for k, t in state.items()}, v)
        for i in range(50):
            inbox.put(i)
        echoes, loaded = [], []
        while len(echoes) < 50 or not loaded or loaded[-1][0] < 10:
            kind, *rest = outbox.get(timeout=60)
            (echoes if kind == "echo" else loaded).append(rest)
        assert [e[0] for e in echoes] == list(range(50))  # FIFO, nothing lost or doubled
        versions = [v for v, _ in loaded]
        assert versions == sorted(set(versions)) and versions[-1] == 10 and not any(torn for _, torn in loaded)
        assert beats.pid("generator") == pid and beats.age_s("generator") < 2.0
        assert placement.exited() == []
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while not placement.exited():
            assert time.monotonic() - killed < 5.0, "a killed actor was not reported"
            time.sleep(0.02)
        assert [(e.name, e.exitcode) for e in placement.exited()] == [("generator", None)]
    finally:
        placement.shutdown(placement.stop_flag(), 2.0)
    deadline = time.monotonic() + 10
    while ray_processes(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(temp_dir)
    assert not Path(temp_dir).exists()
