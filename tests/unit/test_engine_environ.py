"""A generator replica's process (torch engine or vLLM) starts with OpenMP's passive wait policy
(its threads sleep at a barrier instead of spinning on a shared machine), unless the user chose
one; no other actor gets it, and the trainer's own environment is left as it was."""

from __future__ import annotations

import multiprocessing as mp
import os

from gapless.cluster.placement import LocalPlacement, engine_environ
from gapless.config import load_config


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
