"""A generator replica's process (torch engine or vLLM) starts with OpenMP's passive wait policy
(its threads sleep at a barrier instead of spinning on a shared machine), unless the user chose
one; no other actor gets it, and the trainer's own environment is left as it was. The commands
whose process runs an engine (`serve`, `serve-training`, `eval`) get it before torch loads OpenMP,
as OpenMP itself reports in the real process; `train`'s process (the trainer's) keeps the default.
A replica placed by Ray: tests/integration/test_ray_placement.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gapless.cluster.placement import LocalPlacement, engine_environ
from gapless.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _report(queue) -> None:
    queue.put(os.environ.get("OMP_WAIT_POLICY"))


class _Spec:
    def __init__(self, cfg, queue):
        self.cfg, self.queue = cfg, queue


def _main(spec) -> None:
    _report(spec.queue)


def test_only_generator_replicas_get_the_passive_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    torch_cfg, vllm_cfg = load_config(None, {}), load_config(None, {"generator.engine": '"vllm"'})
    assert engine_environ("generator", torch_cfg) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_environ("generator-1", torch_cfg) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_environ("generator", vllm_cfg) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_environ("environment", torch_cfg) == {} and engine_environ("trainer", torch_cfg) == {}
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert engine_environ("generator", torch_cfg) == {}  # the user's choice stands


def test_the_spawned_replica_has_it_and_the_parent_does_not(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    placement = LocalPlacement()
    queue = placement.ctx.Queue()
    cfg = load_config(None, {})
    placement.start("generator", _main, _Spec(cfg, queue))
    placement.start("environment", _main, _Spec(cfg, queue))
    got = sorted(str(queue.get(timeout=60)) for _ in range(2))
    for p in placement.processes.values():
        p.join(timeout=60)
    assert got == ["None", "PASSIVE"] and "OMP_WAIT_POLICY" not in os.environ
    assert isinstance(placement.ctx, type(mp.get_context("spawn")))


def _spin_count(argv: list[str], cwd: Path, **env) -> str:
    """The spin count OpenMP's runtime set itself in the real process of `gapless ARGV` (0: the
    passive wait), as libgomp prints it when torch loads it (OMP_DISPLAY_ENV=VERBOSE); the process
    is killed then."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gapless.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(ROOT / "src"), "OMP_DISPLAY_ENV": "VERBOSE", **env},
    )
    timer = threading.Timer(120, proc.kill)  # a process that never loads torch fails the test, never hangs it
    timer.start()
    try:
        for line in proc.stderr:
            if line.strip().startswith("GOMP_SPINCOUNT"):
                return line.split("'")[1]
        return f"no OpenMP report (exit {proc.wait()})"
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("command", "spins"),
    [
        (["eval", str(ROOT / "configs/smoke.toml"), "--run_dir", "run"], "0"),
        (["serve-training", "--port", "0", "--api-key", "tml-x", "--service.checkpoint_dir", "ckpt"], "0"),
        (["serve", "--model.path", "model", "--port", "0"], "0"),
        (["serve", "--model.path", "model", "--port", "0", "--generator.engine", "vllm"], "0"),  # its check loads torch
        (["train", str(ROOT / "configs/smoke.toml"), "--run_dir", "run"], "300000"),  # libgomp's default
    ],
    ids=["eval", "serve-training", "serve", "serve-vllm", "train"],
)
def test_an_engine_commands_process_loads_openmp_with_the_passive_wait(command, spins, tmp_path):
    assert _spin_count(command, tmp_path) == spins


def test_the_users_spin_count_stands_in_an_engine_command(tmp_path):
    command = ["eval", str(ROOT / "configs/smoke.toml"), "--run_dir", "run"]
    assert _spin_count(command, tmp_path, GOMP_SPINCOUNT="1000") == "1000"
