"""The base models of `gapless serve-training` as a client sees them, through the real `tinker` SDK
against a real server: one context rule (capabilities, forward, forward_backward and sample agree,
and refuse with the same message), exact stop reasons, the embedded model's long context, and
tokenizers resolvable by served name from the Hugging Face cache offline, with the cookbook's
Qwen-style renderers working on the embedded tokenizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tinker
import torch
from serve_model import tiny_policy
from tinker import types
from tinker_service import KEY, served

from gapless.config import ConfigError
from gapless.lora import LoraSpec
from gapless.service.hub_cache import MARKER, check_renderer, export_tokenizer
from gapless.service.models import AdamParams, BaseModels, TrainingRun
from gapless.service.wire import DatumIn

CONTEXT = 64


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-models")
    with served(root, max_seq_len=str(CONTEXT)) as (server, policy):
        with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
            yield server, policy, client


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
    )


def _refusal(call) -> str:
    with pytest.raises(tinker.RequestFailedError) as info:
        call()
    return str(info.value)


def test_one_context_rule_everywhere(service):
    server, policy, client = service
    caps = tinker.RestClient(base_url=server.base_url, api_key=KEY).get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [("tiny", CONTEXT)]
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    sampler = client.create_sampling_client(base_model="tiny").result()
    fits = [5 + i % 50 for i in range(CONTEXT + 1)]  # a datum of exactly CONTEXT tokens is served
    trainer.forward([_datum(fits)], "cross_entropy").result()
    too_long = fits + [7]  # a model input of CONTEXT + 1 tokens
    params = types.SamplingParams(max_tokens=1, seed=0)
    messages = [
        _refusal(lambda: trainer.forward([_datum(too_long)], "cross_entropy").result()),
        _refusal(lambda: trainer.forward_backward([_datum(too_long)], "cross_entropy").result()),
        _refusal(lambda: sampler.sample(types.ModelInput.from_ints(too_long[:-1]), 1, params).result()),
    ]
    rule = f"has {CONTEXT + 1} tokens, more than the {CONTEXT}-token context of 'tiny'"
    tails = {m[m.index(rule) : m.index("shorten it")] for m in messages}  # the SDK appends its request id
    assert len(tails) == 1, messages  # the same words from every call
    long_reply = types.SamplingParams(max_tokens=10, seed=0)
    message = _refusal(lambda: sampler.sample(types.ModelInput.from_ints(fits[:60]), 1, long_reply).result())
    assert f"the prompt plus max_tokens has 70 tokens, more than the {CONTEXT}-token context" in message
    assert "max_tokens 4 or less fits this prompt" in message
    ok = sampler.sample(types.ModelInput.from_ints(fits[:54]), 1, long_reply).result()  # 54 + 10 = 64 fits
    assert len(ok.sequences[0].tokens) <= 10


def _stop_case(policy, sampler, prompt):
    """A free sample (no stop, no EOS) and a position k whose token completes a text piece that
    the first k-1 tokens do not contain: the stop string the k-th token completes."""
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, seed=3, stop=[])).result().sequences[0]
    tokens = list(free.tokens)
    for k in range(4, len(tokens)):
        before, text = policy.decode(tokens[: k - 1]), policy.decode(tokens[:k])
        piece = text[len(before) - 1 :] if text.startswith(before) and len(text) > len(before) else ""
        if len(piece) >= 2 and piece not in before and policy.eos_id not in tokens[:k]:
            return tokens, k, piece
    pytest.skip("no sample position completes a fresh stop string")  # not reached with seed 3


def test_stop_reason_exact_on_the_last_allowed_token(service):
    _, policy, client = service
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(policy.encode("Question 3: name"))
    tokens, k, piece = _stop_case(policy, sampler, prompt)
    # a stop string completed by the k-th token, with max_tokens = k: the stop, not the length, ended it
    last = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=k, seed=3, stop=[piece])).result().sequences[0]
    assert list(last.tokens) == tokens[:k] and last.stop_reason == "stop"
    early = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=k - 1, seed=3, stop=[piece])).result()
    assert early.sequences[0].stop_reason == "length"  # one token short of the stop string
    roomy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=k + 5, seed=3, stop=[piece])).result()
    assert list(roomy.sequences[0].tokens) == tokens[:k] and roomy.sequences[0].stop_reason == "stop"
    # a stop token drawn as the last allowed token
    stop_id = tokens[k - 1]
    first = tokens.index(stop_id) + 1  # where stopping on that id ends the sample
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=first, seed=3, stop=[stop_id])).result()
    assert list(by_id.sequences[0].tokens) == tokens[:first] and by_id.sequences[0].stop_reason == "stop"
    short = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=first - 1, seed=3, stop=[stop_id])).result()
    assert short.sequences[0].stop_reason == "length"


def test_builtin_model_gets_the_configured_context(tmp_path):
    policy = tiny_policy()  # saved with 256 positions, as build_tiny makes the embedded model
    short = torch.tensor([policy.encode("Question 3: name 2 fruits.")])
    with torch.no_grad():
        before = policy.model(input_ids=short).logits
    bases = BaseModels({}, builtin=lambda: policy, tokenizer_root=tmp_path)
    base = bases.get("gapless-tiny")
    assert base.context == 4096 and policy.model.config.max_position_embeddings == 4096
    ids = torch.randint(5, 200, (1, 4096))
    with torch.no_grad():  # rotary positions: a 4096-token forward runs on the model built with 256
        assert policy.model(input_ids=ids).logits.shape == (1, 4096, policy.model.config.vocab_size)
        after = policy.model(input_ids=short).logits  # the head untied and <think>, </think> added: same logits
        assert torch.equal(after[..., : before.shape[-1]], before) and after.shape[-1] == before.shape[-1] + 2
    head, embed = policy.model.get_output_embeddings().weight, policy.model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr()
    # a LoRA client's train_unembed now adapts the head (a tied head would be frozen with the embedding)
    run = TrainingRun("m", base, LoraSpec(rank=2, seed=0))
    tokens = policy.encode("Question 3: name 2 fruits. Answer: apple.")
    run.forward_backward(
        [DatumIn(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:])})], "cross_entropy", {}, False
    )
    run.optim_step(AdamParams(learning_rate=1e-2))
    assert not torch.equal(run.sampler_state()["lm_head.weight"], embed)


def test_served_names_and_renderers(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    policy = tiny_policy()
    bases = BaseModels(
        {"Qwen/Qwen3-8B": {}, "Qwen/Qwen3-4B-Instruct-2507": {}, "plain": {"renderer": "qwen3_disable_thinking"}},
        builtin=lambda: policy,
        tokenizer_root=tmp_path / "tok",
        export_tokenizers=True,
    )
    assert [bases.get(n).renderer for n in bases.names] == ["qwen3", "qwen3_instruct", "qwen3_disable_thinking"]
    assert bases.get("Qwen/Qwen3-8B").policy is policy and bases.get("plain").policy is not policy  # own copies
    # a client process, offline, loads the tokenizer by served name: transformers and the cookbook
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from tinker_cookbook.tokenizer_utils import get_tokenizer\n"
        "from tinker_cookbook import renderers\n"
        "t, c = AutoTokenizer.from_pretrained('Qwen/Qwen3-8B'), get_tokenizer('plain')\n"
        "r = renderers.get_renderer('qwen3', c)\n"
        "p = r.build_generation_prompt([{'role': 'user', 'content': 'Name 3 fruits.'}]).to_ints()\n"
        "print(json.dumps([t.encode(sys.argv[1], add_special_tokens=False), c.decode(p)]))\n"
    )
    text = "Question 12: name 3 fruits.<|im_end|>"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script, text], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ids, prompt = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids == policy.tokenizer.encode(text, add_special_tokens=False)
    assert prompt == "<|im_start|>user\nName 3 fruits.<|im_end|>\n<|im_start|>assistant\n"
    # a repository the cache holds from elsewhere is never overwritten
    foreign = cache / "models--org--real" / "snapshots" / ("a" * 40)
    foreign.mkdir(parents=True)
    (cache / "models--org--real" / "refs").mkdir()
    (cache / "models--org--real" / "refs" / "main").write_text("a" * 40)
    assert "not written by gapless" in export_tokenizer("org/real", tmp_path / "tok" / "plain")
    assert sorted(p.name for p in (cache / "models--org--real" / "snapshots").iterdir()) == ["a" * 40]
    snapshots = list((cache / "models--Qwen--Qwen3-8B" / "snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / MARKER).is_file()
    assert export_tokenizer("Qwen/Qwen3-8B", tmp_path / "tok" / "Qwen_Qwen3-8B") is None  # unchanged: no new snapshot
    assert list((cache / "models--Qwen--Qwen3-8B" / "snapshots").iterdir()) == snapshots


def test_a_renderer_that_does_not_fit_the_tokenizer_is_a_config_error(tmp_path):
    policy = tiny_policy()
    for name in ("qwen3", "qwen3_disable_thinking", "qwen3_instruct", "role_colon"):
        assert check_renderer(name, policy.tokenizer) is None, name
    bases = BaseModels({"m": {"renderer": "no_such_renderer"}}, builtin=lambda: policy, tokenizer_root=tmp_path)
    with pytest.raises(ConfigError, match=re.escape("service.base_models.'m'.renderer")):
        bases.get("m")
