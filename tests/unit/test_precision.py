"""Precision and memory options: bf16 weights through the engine and the trainer, the float32 LM
head (closer to the fp32 log-probs than a bf16 head), gradient checkpointing (same update), and
the precision a checkpoint was saved with restored on load."""

import copy

import pytest
import torch

from gapless.config import ConfigError, ModelConfig, TrainerConfig
from gapless.generate.engine import TorchEngine
from gapless.models import FP32Head, apply_precision, build_tiny, load_local
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import SamplingParams

SIZES = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)


@pytest.fixture(scope="module")
def fp32(problems):
    return build_tiny(ModelConfig(**SIZES), [p.prompt + p.solution for p in problems], seed=0)


def _variant(policy, **fields):
    pol = copy.copy(policy)
    pol.model = apply_precision(copy.deepcopy(policy.model), ModelConfig(**SIZES, **fields))
    return pol


def _completions(policy, problems, n=4):
    prompts = [policy.encode(p.prompt) for p in problems[:n]]
    return TorchEngine(policy.model, policy.eos_id).generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    )


def test_bf16_engine_and_trainer_agree_up_to_bf16_rounding(fp32, problems):
    bf16 = _variant(fp32, dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    completions = _completions(bf16, problems)
    batch = build_batch(completions, [1.0] * 4, [True] * 4, bf16.pad_id)
    with torch.no_grad():
        trainer_lp = token_logprobs(bf16.model, batch.input_ids, batch.attention_mask)
    gap = ((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max()
    assert gap < 0.1  # bf16 keeps 8 bits of mantissa: ~1% per op, not fp32's 1e-5


def test_fp32_head_brings_bf16_logprobs_closer_to_fp32(fp32, problems):
    completions = _completions(fp32, problems)
    batch = build_batch(completions, [1.0] * 4, [True] * 4, fp32.pad_id)
    errors = {}
    with torch.no_grad():
        exact = token_logprobs(fp32.model, batch.input_ids, batch.attention_mask)
        for head in (False, True):
            model = _variant(fp32, dtype="bfloat16", fp32_lm_head=head).model
            assert isinstance(model.get_output_embeddings(), FP32Head) == head
            got = token_logprobs(model, batch.input_ids, batch.attention_mask)
            errors[head] = float(((got - exact).abs() * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert errors[True] < errors[False], errors


def test_gradient_checkpointing_gives_the_same_update(fp32, problems):
    completions = _completions(fp32, problems)
    batch = build_batch(completions, [1.0, -1.0, 0.5, -0.5], [True] * 4, fp32.pad_id)
    after = []
    for checkpointing in (False, True):
        model = copy.deepcopy(fp32.model)
        trainer = GRPOTrainer(model, TrainerConfig(gradient_checkpointing=checkpointing, micro_batch_size=2), 1.0, 12)
        assert model.is_activation_checkpointing == checkpointing
        trainer.step(batch)
        after.append(model.state_dict())
    for name, value in after[0].items():
        assert torch.allclose(value, after[1][name], atol=1e-6), name


def test_precision_is_saved_with_the_checkpoint(fp32, tmp_path):
    _variant(fp32, dtype="bfloat16", fp32_lm_head=True).save(tmp_path)
    loaded = load_local(tmp_path)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16 and isinstance(
        loaded.model.get_output_embeddings(), FP32Head
    )
    assert next(load_local(tmp_path, precision=ModelConfig()).model.parameters()).dtype == torch.float32


def test_fp32_head_refused_where_the_head_is_not_plain(problems):
    with pytest.raises(ConfigError, match="model.fp32_lm_head"):
        build_tiny(ModelConfig(**SIZES, architecture="gemma2", fp32_lm_head=True), [p.prompt for p in problems], seed=0)
