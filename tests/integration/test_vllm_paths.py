"""`gapless train --generator.engine vllm` on the paths past the synchronous and budget runs:
replicas placed by Ray, a LoRA run (only the adapter goes to vLLM, a LoRA request of its own per
version, the base never reloaded) and the multi-turn `repo` task. Each run, at budget 1 under the
crash harness, exits 0, leaves no process behind, and keeps the ledger exactly once
(ledger.check_ledger) with no group trained past the budget. Slow: each starts two or three vLLM
engines, minutes on 2 loaded cores (by hand: `-m "vllm and slow"`); the recorded runs are in
docs/lab/2026-12-07-vllm-paths-2.md."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from crash import train
from safetensors import safe_open

from gapless.orchestrate.ledger import check_ledger, read_events

CONFIG = str(Path(__file__).parents[2] / "configs" / "smoke.toml")
STEPS = 3
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]
SMOKE_AT_HEAD_DIM_32 = [CONFIG, "--model.num_heads", "1", "--model.num_kv_heads", "1"]


def _run(tmp_path: Path, warm_cache: Path, args: list[str]) -> tuple[Path, str]:
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--warmstart.cache_dir", str(warm_cache), "--generator.engine", "vllm"]
    common += ["--pipeline.max_staleness", "1", "--loop.steps", str(STEPS), "--loop.eval_every", str(STEPS)]
    outcome = train([*args, *common, "--metrics.tensorboard", "false"], tmp_path / "run.err", timeout_s=900)
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == []
    per_step = json.loads((run / "config.json").read_text())["loop"]["prompts_per_step"]
    events = read_events(run / "groups.jsonl")
    check_ledger(events, STEPS, per_step)
    assert {e["staleness"] for e in events if e["event"] == "trained"} <= {0, 1}
    return run, outcome.stderr


def _spans(run: Path, actor: str) -> list[dict]:
    return [
        json.loads(line) for f in (run / "timeline").glob(f"{actor}-*.jsonl") for line in f.read_text().splitlines()
    ]


def test_ray_placed_vllm_replicas(tmp_path, warm_cache):
    pytest.importorskip("ray")
    run, _ = _run(
        tmp_path, warm_cache, [*SMOKE_AT_HEAD_DIM_32, "--cluster.placement", "ray", "--cluster.replicas", "2"]
    )
    placed = json.loads((run / "placement.json").read_text())
    assert [b["actor"] for b in placed["bundles"]] == ["generator-0", "generator-1", "environment"]
    for replica in ("generator-0", "generator-1"):
        spans = _spans(run, replica)
        assert any(s["name"] == "generate" for s in spans), replica
        assert {s["args"]["version"] for s in spans if s["name"] == "weights"} >= {1, 2}, replica


def _tensor_bytes(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def test_a_lora_run_sends_vllm_the_adapter_alone(tmp_path, warm_cache, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # vLLM names each LoRA it adds (and each full reload)
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # where the harness reads (vLLM's default: stdout)
    run, stderr = _run(tmp_path, warm_cache, [*SMOKE_AT_HEAD_DIM_32, "--lora.rank", "8"])
    pushed = [m["perf/weight_push_mb"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "perf/weight_push_mb" in m]  # fmt: skip
    adapters = sorted((run / "vllm").glob("policy-*-lora/v*/adapter_model.safetensors"))
    base = next((run / "vllm").glob("policy-*/model.safetensors"))
    assert len(pushed) == STEPS and adapters
    assert all(abs(mb * 1e6 - _tensor_bytes(adapters[-1])) < 1 for mb in pushed)  # the adapter's bytes
    assert _tensor_bytes(adapters[-1]) < _tensor_bytes(base)
    generator = [line for line in stderr.splitlines() if "gapless-generator" in line]
    added = [int(m.group(1)) for line in generator if (m := re.search(r"Adding lora\. Model id: (\d+)", line))]
    assert added == sorted(set(added)) and len(added) >= 2  # each version a LoRA id of its own, none reused
    assert not [line for line in generator if "Reloading and processing weights" in line]  # base never reloaded


def test_repo_episodes_on_vllm(tmp_path, warm_cache):
    model = ["--model.hidden_size", "64", "--model.num_layers", "2", "--model.intermediate_size", "128",
             "--model.vocab_size", "384", "--model.num_heads", "2", "--model.num_kv_heads", "1"]  # fmt: skip
    repo = ["--task.name", "repo", "--repo.num_train_prompts", "16", "--repo.num_eval_prompts", "4",
            "--repo.max_output_bytes", "96", "--repo.max_turns", "4", "--repo.missing_frac", "1.0",
            "--warmstart.steps", "100", "--warmstart.batch_size", "16", "--warmstart.lr", "5e-3",
            "--generator.group_size", "4", "--generator.max_new_tokens", "40", "--loop.prompts_per_step", "2"]  # fmt: skip
    run, _ = _run(tmp_path, warm_cache, [*model, *repo])
    turns = [m["rollout/turns_mean"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "rollout/turns_mean" in m]  # fmt: skip
    assert len(turns) == STEPS and max(turns) > 1  # episodes of several turns, each a vLLM generation
