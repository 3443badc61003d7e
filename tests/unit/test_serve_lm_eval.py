"""lm-eval itself against `gapless serve` (a subprocess on a tiny checkpoint), as its users run it:
the `local-completions` model on a task file written here (no hub), loglikelihood and
generate_until. Its loglikelihoods must equal a plain transformers forward pass of the same
checkpoint (loaded with AutoModelForCausalLM / AutoTokenizer) within 1e-3 -- including requests
whose one generated token is EOS, which lm-eval takes as the last log-prob entry and drops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from serve_model import tiny_policy

lm_eval = pytest.importorskip("lm_eval")
SRC = Path(__file__).resolve().parents[2] / "src"
DOCS = [
    {"question": f"Question {i}: name {i % 7} fruits.", "choices": [" apple", " red, cat", f" {i}."], "label": i % 3}
    for i in range(6)
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The serving tests' tiny model, with EOS's (tied) embedding row turned towards what sets the
    last hidden state of one loglikelihood request apart from the questions' states: greedy decoding
    ends there at once (as a trained model's does at the end of an answer), not after a question."""
    policy = tiny_policy()
    tok, model = policy.tokenizer, policy.model
    answer = tok.encode(DOCS[0]["question"] + DOCS[0]["choices"][0], add_special_tokens=False)
    questions = tok.encode(" ".join(d["question"] for d in DOCS), add_special_tokens=False)
    with torch.no_grad():
        last = model(input_ids=torch.tensor([answer]), output_hidden_states=True).hidden_states[-1][0, -1]
        typical = model(input_ids=torch.tensor([questions]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.get_output_embeddings().weight[policy.eos_id] = 2 * (last - typical) / (last - typical).norm()
    path = tmp_path_factory.mktemp("lm-eval") / "tiny"
    policy.save(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from gapless.cli import main; sys.exit(main())",
            "serve",
            "--model.path",
            str(checkpoint),
            "--port",
            "0",
            "--threads",
            "1",
            "--model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    deadline, url = time.monotonic() + 120, None
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            pytest.fail("gapless serve exited before serving")
        if line.startswith("serving "):
            url = line.split(" at ")[-1].strip()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _tasks(root: Path) -> Path:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "ll.yaml").write_text(
        "task: gapless_ll\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    # four stops of the task's own; lm-eval adds the tokenizer's EOS text as a fifth
    (root / "gen.yaml").write_text(
        "task: gapless_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n', 'Question', 'zzz', '!!']\n  max_gen_toks: 12\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


def test_lm_eval_local_completions(server, checkpoint, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server}/completions",
            "model": "tiny",
            "tokenizer": str(checkpoint),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_retries": 1,
        },
        tasks=["gapless_ll", "gapless_gen"],
        task_manager=TaskManager(include_path=str(_tasks(tmp_path))),
        log_samples=True,
        apply_chat_template=False,
    )
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ends_in_eos = 0
    for sample in out["samples"]["gapless_ll"]:
        for (context, continuation), [(loglik, _)] in zip(sample["arguments"], sample["resps"]):
            whole = tok.encode(context + continuation, add_special_tokens=False)
            n_ctx = len(tok.encode(context, add_special_tokens=False))
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([whole])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            want = sum(logp[t - 1, whole[t]].item() for t in range(n_ctx, len(whole)))
            assert loglik == pytest.approx(want, abs=1e-3), (context, continuation)
            ends_in_eos += int(logits[-1].argmax().item() == tok.eos_token_id)
    assert ends_in_eos >= 1  # the case lm-eval used to get wrong is in the set
    generations = [s["resps"][0][0] for s in out["samples"]["gapless_gen"]]
    assert len(generations) == len(DOCS) and all(isinstance(g, str) for g in generations)
    assert any(generations) and not any("Question" in g or "<|eos|>" in g for g in generations)
