"""The generator contract, run against every generator: the reference sampler and the torch engine."""

import pytest
import torch

from gapless.generate.engine import TorchEngine
from gapless.generate.sampler import TorchSampler
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.types import SamplingParams

GENERATORS = {
    "reference": lambda policy: TorchSampler(policy.model, policy.eos_id, policy.pad_id),
    "torch": lambda policy: TorchEngine(policy.model, policy.eos_id, max_batch=4),  # < prompts: refills
}


@pytest.fixture(params=sorted(GENERATORS))
def make(request):
    return GENERATORS[request.param]


def _prompts(policy, problems, k=6):
    return [policy.encode(p.prompt) for p in problems[:k]]  # mixed lengths


def test_kv_cache_decoding_equals_full_recomputation(make, tiny_policy, problems):
    sampler = make(tiny_policy)
    prompts = _prompts(tiny_policy, problems)
    assert len({len(p) for p in prompts}) > 1
    completions = sampler.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8))
    for c in completions:
        seq = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = tiny_policy.model(input_ids=seq).logits[0]  # (L, V), no cache, no padding
        steps = logits[len(c.prompt_ids) - 1 : len(seq[0]) - 1]
        assert steps.argmax(-1).tolist() == c.token_ids
        full = torch.log_softmax(steps, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(full, torch.tensor(c.logprobs), atol=1e-5)


def test_sampling_logprobs_equal_trainer_logprobs(make, tiny_policy, problems):
    """Invariant 5: at the same weights the importance ratio is exactly 1 (fp32 tolerance)."""
    sampler = make(tiny_policy)
    params = SamplingParams(temperature=0.7, max_new_tokens=10, seed=3)
    completions = sampler.generate(_prompts(tiny_policy, problems), params)
    batch = build_batch(completions, [1.0] * len(completions), [True] * len(completions), tiny_policy.pad_id)
    with torch.no_grad():
        trainer_lp = token_logprobs(tiny_policy.model, batch.input_ids, batch.attention_mask, temperature=0.7)
    diff = ((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max()
    assert diff < 1e-5
    assert batch.num_tokens == sum(len(c.token_ids) for c in completions)


def test_sampling_is_reproducible_and_versions_recorded(make, tiny_policy, problems):
    sampler = make(tiny_policy)
    sampler.version = 7
    params = SamplingParams(max_new_tokens=6, seed=11)
    a = sampler.generate(_prompts(tiny_policy, problems), params)
    b = sampler.generate(_prompts(tiny_policy, problems), params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for c in a:
        assert c.versions == [7] * len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tiny_policy.eos_id)
        assert len(c.token_ids) <= 6


def test_top_p_keeps_only_the_nucleus():
    from gapless.generate.sampler import sample_next

    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, SamplingParams(top_p=0.8), gen)[0]) for _ in range(200)}
    assert picks == {0, 1}


def test_saved_policy_reloads_with_identical_tokenization_and_weights(tiny_policy, problems, tmp_path):
    from gapless.models import load_local

    tiny_policy.save(tmp_path / "ckpt")
    loaded = load_local(tmp_path / "ckpt")
    for p in problems[:10]:
        assert loaded.encode(p.prompt + p.solution) == tiny_policy.encode(p.prompt + p.solution)
    assert (loaded.eos_id, loaded.pad_id) == (tiny_policy.eos_id, tiny_policy.pad_id)
    for (k, a), b in zip(tiny_policy.model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a, b), k
