"""Every model family the torch engine claims, on tiny random checkpoints of the real HF
architectures: greedy tokens equal `generate`, cached decoding equals a full forward pass (through
each family's sliding window: contexts are longer than the 16-token windows of the tiny configs),
sampling log-probs equal the trainer's, and the engine path taken is the one `families` names.
llama and qwen2 run the same checks in test_engine.py."""

import logging

import pytest
import torch
from engine_model import tiny_in

from gapless.generate.engine import TorchEngine
from gapless.generate.families import engine_path
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.types import SamplingParams

LEAN = ["qwen3", "mistral", "phi3", "olmo2"]
GENERIC = ["gemma2", "gemma3"]


def _randomise(model, seed: int):
    """Larger random weights and non-trivial norm weights, so outputs vary and every norm matters."""
    gen = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")  # gemma norms scale by (1 + weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(noise * 0.15)
            elif "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
    return model


@pytest.fixture(scope="module", params=LEAN + GENERIC)
def policy(request, problems):
    pol = tiny_in(request.param, [p.prompt + p.solution for p in problems])
    _randomise(pol.model, seed=1)
    return pol


def _kernels(policy):
    return ["native", "torch"] if engine_path(policy.model.config)[0] == "lean" else ["auto"]


def _prompts(policy, problems, k=3):
    return [policy.encode(p.prompt) for p in problems[:k]]


def test_path_is_logged_and_as_claimed(policy, caplog):
    family = policy.model.config.model_type
    with caplog.at_level(logging.INFO, logger="gapless.generate.engine"):
        engine = TorchEngine(policy.model, policy.eos_id)
    want = "lean" if family in LEAN else "generic"
    assert engine.path == want
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")] == [
        engine_path(policy.model.config)[1]
    ]
    assert f"engine: {'lean runner' if want == 'lean' else 'generic path'} for {family}" in caplog.text


def test_greedy_equals_transformers_generate(policy, problems):
    prompts = _prompts(policy, problems)
    assert min(map(len, prompts)) + 12 > 16  # decoding crosses the sliding window
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = policy.model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=12,
                pad_token_id=policy.pad_id,
                eos_token_id=policy.eos_id,
            )
        refs.append(out[0, len(p) :].tolist())
    for kernels in _kernels(policy):
        got = TorchEngine(policy.model, policy.eos_id, max_batch=2, kernels=kernels).generate(
            prompts, SamplingParams(greedy=True, max_new_tokens=12)
        )
        for c, ref in zip(got, refs):
            assert c.token_ids == ref[: len(c.token_ids)], kernels
        assert len({tuple(c.token_ids) for c in got}) > 1


def test_cached_decoding_equals_full_recomputation(policy, problems):
    for kernels in _kernels(policy):
        engine = TorchEngine(policy.model, policy.eos_id, max_batch=2, kernels=kernels)
        for c in engine.generate(
            _prompts(policy, problems), SamplingParams(greedy=True, max_new_tokens=10, ignore_eos=True)
        ):
            with torch.no_grad():
                logits = policy.model(input_ids=torch.tensor([c.prompt_ids + c.token_ids])).logits[0]
            steps = logits[len(c.prompt_ids) - 1 : -1]
            full = torch.log_softmax(steps, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            assert steps.argmax(-1).tolist() == c.token_ids, kernels
            assert torch.allclose(full, torch.tensor(c.logprobs), atol=1e-5), (
                kernels,
                (full - torch.tensor(c.logprobs)).abs().max(),
            )


def test_sampling_logprobs_equal_trainer_logprobs(policy, problems):
    """Groups share one prefill (a stash serves the samples admitted later); ratio exactly 1."""
    for kernels in _kernels(policy):
        engine = TorchEngine(policy.model, policy.eos_id, max_batch=4, kernels=kernels)
        prompts = [p for p in _prompts(policy, problems, 2) for _ in range(3)]
        completions = engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=10, seed=3))
        batch = build_batch(completions, [1.0] * len(completions), [True] * len(completions), policy.pad_id)
        with torch.no_grad():
            trainer_lp = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, temperature=0.9)
        assert ((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max() < 1e-5, kernels


def test_in_flight_swap_on_every_path(policy, problems):
    """A swap between steps: versions recorded per token, and with recompute_kv the tokens after
    it are what the new weights produce from the whole context."""
    new = _randomise(type(policy.model)(policy.model.config), seed=2).eval()
    engine = TorchEngine(policy.model, policy.eos_id, max_batch=4, recompute_kv=True)
    params = SamplingParams(greedy=True, max_new_tokens=8, ignore_eos=True)
    for p in _prompts(policy, problems, 2):
        engine.add_request(p, params)
    for _ in range(3):
        assert engine.step() == []
    engine.update_weights(new.state_dict(), version=1)
    done = []
    while engine.has_work:
        done += engine.step()
    for c in done:
        assert c.versions == [0] * 3 + [1] * 5
        with torch.no_grad():
            logits = new(input_ids=torch.tensor([c.prompt_ids + c.token_ids])).logits[0]
        assert logits[len(c.prompt_ids) + 2 : -1].argmax(-1).tolist() == c.token_ids[3:]


def test_unsupported_checkpoint_is_one_line_config_error(tmp_path, tiny_policy):
    """An encoder-decoder checkpoint: `load_local` refuses it in one line naming the field."""
    from transformers import T5Config, T5Model

    from gapless.config import ConfigError
    from gapless.models import load_local

    T5Model(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)).save_pretrained(tmp_path)
    tiny_policy.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_local(tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.path {tmp_path}: cannot load model type 't5'")
