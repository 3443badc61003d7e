"""The vLLM backend against HF `generate` and the trainer, on vLLM's CPU build (or a GPU).

Run from the vLLM venv:  bash scripts/setup.sh --vllm && .venv-vllm/bin/python -m pytest -m vllm
Skipped where vLLM is absent (tests/conftest.py). Every test shares the session's one engine
(`vllm_engine`, fp32, prefix cache on, LoRA enabled) and leaves `vllm_policy`'s weights in it.
"""

import dataclasses
import threading

import pytest
import torch
from vllm_checks import hf_greedy, perturbed

from gapless.generate.vllm.engine import VLLMEngine
from gapless.lora import LoraSpec, adapter_state, attach_lora
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.types import SamplingParams

pytestmark = pytest.mark.vllm


def _prompts(policy, problems, k=6):
    return [policy.encode(p.prompt) for p in problems[:k]]


def _trainer_gap(model, policy, completions, temperature):
    batch = build_batch(completions, [1.0] * len(completions), [True] * len(completions), policy.pad_id)
    with torch.no_grad():
        trainer_lp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)
    return float(((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max())


@pytest.fixture
def engine(vllm_engine, vllm_policy):
    yield vllm_engine
    vllm_engine.abort({s.request_id for s in vllm_engine.running})
    vllm_engine.update_weights(vllm_policy.model.state_dict(), version=vllm_engine.version + 1)


def test_greedy_equals_transformers_generate_before_and_after_a_push(engine, vllm_policy, problems):
    prompts = _prompts(vllm_policy, problems)
    for model in (vllm_policy.model, perturbed(vllm_policy, 1)):
        engine.update_weights(model.state_dict(), version=engine.version + 1)
        got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
        for prompt, c in zip(prompts, got):
            assert c.token_ids == hf_greedy(model, vllm_policy, prompt, 10)
            assert c.versions == [engine.version] * len(c.token_ids)


def test_sampled_logprobs_equal_the_trainers(engine, vllm_policy, problems):
    completions = engine.generate(
        _prompts(vllm_policy, problems), SamplingParams(temperature=0.7, max_new_tokens=12, seed=3)
    )
    assert sum(len(c.token_ids) for c in completions) > 12
    assert _trainer_gap(vllm_policy.model, vllm_policy, completions, 0.7) < 1e-4


def test_swap_mid_generation_then_abort_and_resume(engine, vllm_policy, problems):
    """Tokens before the swap carry the old version, after it the new; each token's log-prob is
    the one its version's weights give (the swap recomputes the prefix under the new weights)."""
    new = perturbed(vllm_policy, 2)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=1)
    v0 = engine.version
    ids = [engine.add_request(p, params, n=2) for p in _prompts(vllm_policy, problems, 3)]
    for _ in range(4):
        engine.step()
    engine.update_weights(new.state_dict(), version=v0 + 1)
    partials = engine.abort([ids[0]])
    assert [c.finish_reason for c in partials] == ["abort", "abort"] and all(
        0 < len(c.token_ids) < 12 for c in partials
    )
    engine.resume(partials, params)
    done = []
    while engine.has_work:
        done += engine.step()
    assert len(done) == 6 and sum(c.versions[0] == v0 for c in done) == 4  # 4 slots: two waited for one
    for c in done:
        assert len(c.token_ids) == 12 and c.versions == sorted(c.versions) and c.versions[-1] == v0 + 1
        cut = c.versions.index(v0 + 1)
        old = dataclasses.replace(c, token_ids=c.token_ids[:cut], logprobs=c.logprobs[:cut], versions=c.versions[:cut])
        assert _trainer_gap(vllm_policy.model, vllm_policy, [old], 1.0) < 1e-4
        # the new weights' log-probs of the post-swap tokens, given the whole prefix
        batch = build_batch([c], [1.0], [True], vllm_policy.pad_id)
        with torch.no_grad():
            lp = token_logprobs(new, batch.input_ids, batch.attention_mask)[0]
        start = len(c.prompt_ids) - 1
        assert (lp[start + cut : start + 12] - torch.tensor(c.logprobs[cut:])).abs().max() < 1e-4


def test_a_push_from_another_thread_lands_between_steps(engine, vllm_policy, problems):
    """Never torn: the push waits for the step in progress; every token's version is one whole
    version, and the versions of a sample only ever rise."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=4)
    v0 = engine.version
    for p in _prompts(vllm_policy, problems, 2):
        engine.add_request(p, params, n=2)
    engine.step()
    pusher = threading.Thread(target=engine.update_weights, args=(vllm_policy.model.state_dict(), v0 + 1))
    pusher.start()
    done = []
    while engine.has_work or pusher.is_alive():
        done += engine.step()
    pusher.join()
    assert len(done) == 4 and engine.version == v0 + 1
    assert all(set(c.versions) <= {v0, v0 + 1} and c.versions == sorted(c.versions) for c in done)


def test_lora_adapter_swap_goes_to_vllm_as_a_lora_request(engine, vllm_policy, problems):
    """Only the adapter is pushed (one LoRA request per version); vLLM's outputs equal the
    adapted model's, and a second version changes them to that version's."""
    prompts = _prompts(vllm_policy, problems, 4)
    spec = LoraSpec(rank=4, alpha=16.0, seed=0, train_attn=True, train_mlp=True)
    for version_seed in (5, 6):
        adapted = attach_lora(vllm_policy.model, spec)
        g = torch.Generator().manual_seed(version_seed)
        with torch.no_grad():
            for name, p in adapted.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        state = adapter_state(adapted)
        assert all("lora_" in k for k in state)
        engine.update_weights(state, version=engine.version + 1)
        assert engine.weights.lora_request().lora_int_id == engine.version + 1
        got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8))
        for prompt, c in zip(prompts, got):
            assert c.token_ids == hf_greedy(adapted, vllm_policy, prompt, 8)
        sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=7))
        assert _trainer_gap(adapted, vllm_policy, sampled, 1.0) < 1e-4


def test_seeded_prompts_longer_than_one_steps_token_budget(engine, vllm_policy, problems):
    """Four seeded ~100-token contexts against a 128-token step budget: on CPU each prefill runs
    whole in a step of its own (a chunked prefill of a seeded request fails vLLM-CPU's step)."""
    text = " ".join(p.prompt for p in problems[:40])
    long = vllm_policy.encode(text)[:100]
    assert len(long) == 100
    out = engine.generate([long[i:] for i in range(4)], SamplingParams(temperature=1.0, max_new_tokens=8, seed=9))
    assert [len(c.token_ids) for c in out] == [8] * 4 or all(
        c.finish_reason == "stop" for c in out if len(c.token_ids) < 8
    )
    assert _trainer_gap(vllm_policy.model, vllm_policy, out, 1.0) < 1e-4


def test_one_engine_per_process(engine, vllm_policy, tmp_path):
    with pytest.raises(RuntimeError, match="one engine per process"):
        VLLMEngine(str(tmp_path), vllm_policy.eos_id)
