"""End to end: `gapless serve` runs in a subprocess over a locally built tiny model, answers the
OpenAI-style endpoints, and the judge environment scores completions through it. A barely trained
tiny judge writes partly garbage, so the tolerant parser is exercised for real; a random one
(in-process, through LocalJudgeClient) writes nothing but garbage."""

from __future__ import annotations

import copy
import json
import os
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from gapless.config import ModelConfig
from gapless.envs.judge.client import HttpJudgeClient, LocalJudgeClient
from gapless.envs.judge.environment import JudgeEnvironment, embedded_judge_tasks
from gapless.generate.sampler import TorchSampler
from gapless.models import build_tiny
from gapless.trainer.batch import token_logprobs
from gapless.trainer.warmstart.pairs import supervised_batch
from gapless.types import Completion

SRC = Path(__file__).resolve().parents[2] / "src"
RESPONSES = ["Red, blue.", "good: Mars", "banana", "good: oak, elm", "zzz", "good: a violin"]
RUBRIC = "{prompt}\n<response>\n{response}\n</response>\nScore:"  # short: cheap to train on
STATUSES = {"ok", "scored", "judge_unparsable"}


def judge_policy():
    """A tiny model trained for a few steps to answer a rubric with ' 8' (responses starting
    with 'good') or ' 2': just enough to write a score some of the time."""
    tasks = embedded_judge_tasks(0, 4, 2)
    env = JudgeEnvironment(tasks, client=None, rubric=RUBRIC)
    pairs = [
        (env.judge_prompt(t, r), " 8" if r.startswith("good") else " 2") for t in tasks["train"] for r in RESPONSES
    ]
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    policy = build_tiny(cfg, [p + t for p, t in pairs], seed=0)
    untrained = copy.deepcopy(policy.model)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    policy.model.train()
    for step in range(30):
        ids, attn, mask = supervised_batch(policy, pairs)
        loss = -(token_logprobs(policy.model, ids, attn) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.model.eval()
    return policy, untrained, tasks


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared machine: more threads only contend
    policy, untrained, tasks = judge_policy()
    path = tmp_path_factory.mktemp("judge-model")
    policy.save(path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "serve",
            "--model.path",
            str(path),
            "--port",
            "0",
            "--model-name",
            "tiny-judge",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert " at http://" in line, (
            f"server did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        )
        yield line.rsplit(" at ", 1)[1].strip(), policy, untrained, tasks
    finally:
        torch.set_num_threads(threads)
        proc.terminate()
        proc.wait(timeout=30)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_openai_endpoints(served):
    url, policy, _, _ = served
    with urllib.request.urlopen(f"{url}/models", timeout=30) as response:
        assert json.loads(response.read())["data"][0]["id"] == "tiny-judge"
    body = {
        "model": "tiny-judge",
        "prompt": ["Name 2 fruits.", "Score:"],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
    }
    code, first = post(f"{url}/completions", body)
    assert code == 200 and len(first["choices"]) == 2
    for choice in first["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) <= 6 and all(x <= 0 for x in lp["token_logprobs"])
        # a final EOS is listed with its special-token text (OpenAI, vLLM); the text leaves it out
        assert "".join(lp["tokens"]).removesuffix(policy.tokenizer.eos_token) == choice["text"]
        assert choice["finish_reason"] in ("stop", "length")
    assert post(f"{url}/completions", body)[1]["choices"] == first["choices"]  # greedy: reproducible
    code, chat = post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert code == 200 and isinstance(chat["choices"][0]["message"]["content"], str)
    code, error = post(f"{url}/completions", {"prompt": "x", "max_tokens": -1})
    assert code == 400 and "max_tokens" in error["error"]["message"]
    code, error = post(f"{url}/chat/completions", {"messages": "not a list"})
    assert code == 400 and "messages" in error["error"]["message"]


def test_judge_environment_end_to_end_over_http(served):
    url, _, _, tasks = served
    env = JudgeEnvironment(
        tasks, HttpJudgeClient(url, model="tiny-judge", max_tokens=4, timeout_s=60, concurrency=2), rubric=RUBRIC
    )
    chosen = list(env.tasks("train")[:4])
    groups = [[Completion([1], [2], [0.0], [0], "stop", r) for r in RESPONSES] for _ in chosen]
    rollouts = [r for g in env.score_groups(chosen, groups) for r in g]
    env.close()
    assert {r.status for r in rollouts} <= STATUSES
    assert all(0.0 <= r.reward <= 1.0 and "verdict" in r.info for r in rollouts)
    assert any(r.status != "judge_unparsable" for r in rollouts), [r.info["verdict"] for r in rollouts]


def test_a_random_local_judge_writes_garbage_and_nothing_breaks(served):
    _, policy, untrained, tasks = served
    sampler = TorchSampler(untrained, policy.eos_id, policy.pad_id, policy.decode)
    env = JudgeEnvironment(
        tasks, LocalJudgeClient(sampler, policy.encode, max_new_tokens=8, temperature=1.0), rubric=RUBRIC
    )
    chosen = list(env.tasks("eval"))
    started = time.monotonic()
    groups = env.score_groups(chosen, [[Completion([1], [2], [0.0], [0], "stop", r) for r in RESPONSES]] * len(chosen))
    rollouts = [r for g in groups for r in g]
    assert {r.status for r in rollouts} <= STATUSES and time.monotonic() - started < 30
    assert sum(r.status == "judge_unparsable" for r in rollouts) >= len(rollouts) // 2
