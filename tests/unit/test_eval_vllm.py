"""`gapless eval` with `generator.engine = 'vllm'` (orchestrate/eval_run.py) on the session's vLLM
engine: the run asks for a vLLM generator (its context: the longest eval prompt plus the
completion cap), and greedy scoring on it gives what the reference sampler gives on the same
checkpoint, task for task; k sampled completions per task give pass@k over every sample. The CLI
end to end is in docs/lab/2026-12-07-vllm-paths-2.md."""

from __future__ import annotations

import json
import shutil

import pytest

from gapless.config import load_config
from gapless.orchestrate import eval_run

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


def test_eval_on_vllm_scores_what_the_reference_sampler_scores(vllm_engine, vllm_policy, tmp_path, monkeypatch):
    vllm_policy.save(tmp_path / "model")
    asked = []

    def shared_engine(cfg, policy, max_seq_len, work_dir, log=print, lora=None):
        asked.append((cfg.engine, max_seq_len, lora))
        return vllm_engine  # one vLLM engine per process: the session's, on the same weights

    monkeypatch.setattr(eval_run, "make_generator", shared_engine)
    results = {}
    for engine, samples in (("torch", 1), ("vllm", 1), ("vllm", 3)):
        overrides = {
            "model.path": json.dumps(str(tmp_path / "model")),
            "run_dir": json.dumps(str(tmp_path / f"{engine}-{samples}")),
            "generator.engine": json.dumps(engine),
            "generator.max_new_tokens": "24",
            "task.levels": "[1, 2]",
            "task.num_eval_prompts": "12",
            "eval.samples": str(samples),
        }
        results[engine, samples] = eval_run.run_eval(load_config(None, overrides), log=lambda *_: None)
    assert [a[0] for a in asked] == ["vllm", "vllm"] and asked[0][2] is None
    assert 24 < asked[0][1] <= vllm_engine.max_seq_len  # a prompt plus the completion cap
    torch_run, vllm_run, sampled = results["torch", 1], results["vllm", 1], results["vllm", 3]
    assert vllm_run["num_tasks"] == torch_run["num_tasks"] == 12
    assert [t["completion"] for t in vllm_run["per_task"]] == [t["completion"] for t in torch_run["per_task"]]
    assert vllm_run["pass@1"] == torch_run["pass@1"] and vllm_run["statuses"] == torch_run["statuses"]
    assert not sampled["greedy"] and sum(sampled["statuses"].values()) == 12 * 3
    assert 0.0 <= sampled["pass@1"] <= sampled["pass@3"] <= 1.0
