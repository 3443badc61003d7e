"""Ray placement (cluster/ray/placement.py), on a private Ray instance started by the test.

The one Ray test of the fast suite drives RayPlacement's pieces through a real placed actor:
a 'generator' worker started with OpenMP's passive wait, channels FIFO both ways, heartbeats, progress marks and the actor's pid seen by the trainer, weight versions
that arrive monotonic and never torn (each version fills every tensor with its number, bf16
included), a kill -9 reported by `exited`, and a shutdown that leaves no Ray process behind.
An actor killed by Ray's memory monitor for real (a low threshold, the actor growing past it) is
reported by `exited` with the node's memory figures. The pipeline over Ray (bitwise equal to local at budget 0 on a multi-node cluster, infeasible
placements, a lost replica) is in test_ray_cluster.py (slow).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from ray_echo import EchoSpec, echo_main  # noqa: E402

from gapless.cluster import make_placement  # noqa: E402
from gapless.cluster.placement import Placement  # noqa: E402
from gapless.cluster.ray.deaths import MONITOR_ENV  # noqa: E402
from gapless.cluster.ray.mail import MailboxLost  # noqa: E402
from gapless.config import load_config  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "configs"
HERE = Path(__file__).parent


def ray_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a Ray instance's temporary directory)."""
    # -ww: whole command lines (ps cuts them at 80 columns without a terminal, and the marker comes late)
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if marker in line and "ps -ww" not in line]


def _raylet_env(marker: str) -> dict[str, str]:
    """The environment the private instance's raylet started with."""
    lines = ray_processes(marker)
    pid = next((int(line.split()[0]) for line in lines if line.split()[1].endswith("/raylet")), None)
    assert pid is not None, lines
    return _environ(pid)


def _environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _next(channel, placement, timeout_s: float = 60.0):
    """The channel's next item; an actor that died meanwhile (Ray's memory monitor, a kill) fails
    the wait at once with the placement's diagnosis instead of a bare queue.Empty at its end."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return channel.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            if gone := placement.exited():
                raise AssertionError(
                    "; ".join(f"gapless-{g.name} {g.why or f'exited with code {g.exitcode}'}" for g in gone)
                ) from None
            if time.monotonic() >= deadline:
                raise AssertionError(f"no message within {timeout_s} s and no actor gone") from None


def _get(channel, placement, kind: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        item = _next(channel, placement, deadline - time.monotonic())
        if item[0] == kind:
            return item
    raise AssertionError(f"no {kind!r} message within {timeout_s} s")


def test_a_placed_actor_gets_fifo_messages_and_untorn_weights_and_leaves_nothing(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cfg = load_config(
        CONFIGS / "smoke.toml",
        {"cluster.placement": '"ray"', "pipeline.generator_threads": "1", "cluster.object_store_mb": "100"},
    )
    placement = make_placement(cfg)
    temp_dir = placement.temp_dir
    try:
        assert isinstance(placement, Placement) and placement.kind == "ray"
        if "RAY_memory_usage_threshold" not in os.environ and "RAY_memory_monitor_refresh_ms" not in os.environ:
            assert _raylet_env(temp_dir).get("RAY_memory_usage_threshold") == MONITOR_ENV["RAY_memory_usage_threshold"]
            assert "RAY_memory_usage_threshold" not in os.environ  # the driver's own environment is left as it was
        placement.reserve({"generator": 1})
        state = {
            "w": torch.zeros(3000),
            "b": torch.zeros(7, 5, dtype=torch.bfloat16),
            "i": torch.zeros(4, dtype=torch.int64),
        }
        stop, beats = placement.stop_flag(), placement.heartbeats(("trainer", "generator"))
        inbox, outbox = placement.channel(), placement.channel(8)
        spec = EchoSpec("generator", os.getpid(), inbox, outbox, stop, beats, placement.weights(state, 0), cfg)
        placement.start("generator", echo_main, spec)
        _, pid = _get(outbox, placement, "pid", 120)
        # a replica's worker starts with OpenMP's passive wait (cluster/placement.engine_environ); the driver not
        assert _environ(pid).get("OMP_WAIT_POLICY") == "PASSIVE" and "OMP_WAIT_POLICY" not in os.environ
        assert _get(outbox, placement, "loaded") == ("loaded", 0, False)
        for v in range(1, 11):  # faster than the relay: versions may be skipped, never torn or reordered
            spec.weights.publish({k: torch.full_like(t, v) for k, t in state.items()}, v)
        for i in range(50):
            inbox.put(i)
        echoes, loaded = [], []
        while len(echoes) < 50 or not loaded or loaded[-1][0] < 10:
            kind, *rest = _next(outbox, placement, 60)
            (echoes if kind == "echo" else loaded).append(rest)
        assert [e[0] for e in echoes] == list(range(50))  # FIFO, nothing lost or doubled
        versions = [v for v, _ in loaded]
        assert versions == sorted(set(versions)) and versions[-1] == 10 and not any(torn for _, torn in loaded)
        assert beats.pid("generator") == pid and beats.age_s("generator") < 2.0
        deadline = time.monotonic() + 10  # its progress marks reach the trainer through the mailbox (push and poll)
        while beats.last_progress("generator").marks < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        progress = beats.last_progress("generator")
        assert (progress.marks, progress.what) == (50, "echoed 49") and beats.progress_age_s("generator") >= 0
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


HEADROOM_MB = 1500  # the memory monitor's threshold: this much above what the machine uses before Ray starts


def _memory_used_and_total() -> tuple[int, int]:
    """Bytes in use (total - available, as Ray's memory monitor counts them) and the machine's total."""
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]


def _first_death(placement, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (gone := placement.exited()):
        assert time.monotonic() < deadline, "no actor reported gone"
        time.sleep(0.1)
    return f"gapless-{gone[0].name} {gone[0].why}"


def test_an_actor_killed_by_rays_memory_monitor_is_named_with_the_memory_figures(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    used, total = _memory_used_and_total()
    threshold = (used + (HEADROOM_MB << 20)) / total
    monkeypatch.setenv("RAY_memory_usage_threshold", f"{threshold:.4f}")  # left as set: the run's default is 0.98
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "100")
    cfg = load_config(
        CONFIGS / "smoke.toml",
        {"cluster.placement": '"ray"', "pipeline.generator_threads": "1", "cluster.object_store_mb": "100"},
    )
    placement = make_placement(cfg)
    try:
        placement.reserve({"generator": 1})
        stop, beats = placement.stop_flag(), placement.heartbeats(("trainer", "generator"))
        inbox, outbox = placement.channel(), placement.channel(8)
        spec = EchoSpec(
            "generator", os.getpid(), inbox, outbox, stop, beats, placement.weights({"w": torch.zeros(4)}, 0)
        )
        placement.start("generator", echo_main, spec)
        # Ray chooses whom to kill: the growing actor, or the mailbox (its calls are the newest tasks),
        # and other programs on the machine may pass the threshold first; whichever and whenever, the
        # wait ends with the diagnosis, not a queue.Empty
        with pytest.raises((AssertionError, MailboxLost)) as raised:
            _get(outbox, placement, "pid", 120)
            inbox.put(("hold_mb", 3 * HEADROOM_MB))  # past the threshold well before it holds all of it
            _get(outbox, placement, "held", 120)
        for why in (str(raised.value), _first_death(placement)):
            assert "killed by Ray's memory monitor" in why, why
            assert re.search(r"[\d.]+GB used / [\d.]+GB limit", why), why  # the node's figures, as Ray reported them
            assert "RAY_memory_usage_threshold" in why  # and what to do
    finally:
        placement.shutdown(placement.stop_flag(), 2.0)
