"""`gapless serve --generator.engine vllm` driven by the real `openai` client: the request scheduler
of the torch engine over vLLM's CPU build (or a GPU), one server process for the module (vLLM's
start-up takes tens of seconds). Greedy text equals HF `generate`'s, sampled log-probs equal the
trainer's, chat and stop strings go through the same scheduler, and a request the engine cannot do
(a grammar) is a 400 naming the reason. Plus, in this process on the session's engine, a weight
push through the scheduler while vLLM holds requests: every token carries one whole version."""

from __future__ import annotations

import copy
import time

import openai
import pytest
import torch
from serve_process import start_server
from vllm_checks import hf_greedy

from gapless.serve.protocol import SampleRequest
from gapless.serve.scheduler import Scheduler
from gapless.trainer.batch import token_logprobs
from gapless.types import SamplingParams

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(vllm_policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-vllm") / "model"
    vllm_policy.save(path)
    argv = ["serve", "--model.path", str(path), "--port", "0", "--threads", "1", "--generator.engine", "vllm"]
    proc, url, lines = start_server(
        [*argv, "--max-batch", "4", "--max-seq-len", "256", "--model-name", "tiny"], "serving"
    )
    try:
        assert any("generator: vLLM" in line for line in lines), "".join(lines[-20:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def _trainer_logprobs(model, policy, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[0]
    return lp[len(prompt) - 1 :]


def test_completions_greedy_and_sampled_logprobs(client, vllm_policy, problems):
    for p in problems[:3]:
        prompt = vllm_policy.encode(p.prompt)
        greedy = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
        )
        expected = hf_greedy(vllm_policy.model, vllm_policy, prompt, 10)
        assert greedy.choices[0].model_extra["token_ids"] == expected
        sampled = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0.8,
            seed=3,
            n=2,
            logprobs=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        for choice in sampled.choices:
            tokens = choice.model_extra["token_ids"]
            assert len(tokens) == 12 and choice.finish_reason == "length"
            served = torch.tensor(choice.logprobs.token_logprobs)
            assert (served - _trainer_logprobs(vllm_policy.model, vllm_policy, prompt, tokens, 0.8)).abs().max() < 1e-4


def test_chat_and_stop_strings(client, vllm_policy, problems):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": problems[0].prompt}], max_tokens=12, seed=1
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    prompt = vllm_policy.encode(problems[1].prompt)
    free = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == cut.choices[0].text


def test_a_grammar_is_refused_with_the_reason(client):
    with pytest.raises(openai.BadRequestError, match="constrained decoding"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=8,
            response_format={"type": "json_object"},
        )


def test_a_push_while_vllm_holds_requests_is_never_torn(vllm_engine, vllm_policy, problems):
    """Through the scheduler, on this process's engine: four pushes alternating two sets of
    weights land between steps while samples decode; each sample's versions rise, and every
    token's log-prob is the one its own version's weights give it (so no step mixed weights)."""
    other = copy.deepcopy(vllm_policy.model)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    scheduler = Scheduler(vllm_engine, vllm_policy.decode, name="vllm-push-test")
    try:
        v0 = vllm_engine.version
        models = {v0: vllm_policy.model}
        params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=7)
        prompts = [tuple(vllm_policy.encode(p.prompt)) for p in problems[:3]]
        handles = [scheduler.submit(SampleRequest(p, params, n=2, source="test")) for p in prompts]
        for k in (1, 2, 3, 4):  # ends on vllm_policy's weights, as the session's engine must
            while scheduler.stats.steps < 4 * k:
                time.sleep(0.002)
            models[v0 + k] = other if k % 2 else vllm_policy.model
            scheduler.update_weights(models[v0 + k].state_dict(), v0 + k)
        results = [h.result(timeout_s=300) for h in handles]
        seen = set()
        for prompt, samples in zip(prompts, results):
            for r in samples:
                assert len(r.token_ids) == 24 and r.versions == sorted(r.versions) and set(r.versions) <= set(models)
                seen |= set(r.versions)
                by_version = {
                    v: _trainer_logprobs(m, vllm_policy, list(prompt), r.token_ids, 1.0) for v, m in models.items()
                }
                want = torch.stack([by_version[v][i] for i, v in enumerate(r.versions)])
                assert (want - torch.tensor(r.logprobs)).abs().max() < 1e-4
        assert len(seen) >= 3 and vllm_engine.version == v0 + 4  # pushes landed mid-decode
    finally:
        scheduler.close()
