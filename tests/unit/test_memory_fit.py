"""The start-up memory check: the estimate's terms on hand-computed shapes, and a run that cannot
fit refused with the field to change."""

import pytest

from gapless.config import Config, ConfigError
from gapless.orchestrate.memory_fit import GB, ModelShape, check_fits, estimate_memory

SHAPE = ModelShape(
    params=1000, layers=2, hidden=8, intermediate=32, kv_heads=2, head_dim=4, vocab=100, bytes_per_value=4
)


def config(**sections) -> Config:
    return Config.model_validate(
        {"loop": {"prompts_per_step": 2}, "generator": {"group_size": 4, "max_batch": 64}, **sections}
    )


def test_terms_by_hand():
    est = estimate_memory(config(trainer={"micro_batch_size": 3}), SHAPE, max_seq_len=10)
    assert est.trainer_state == 1000 * 4 * 4  # weights, gradients, two AdamW moments
    assert est.micro_batch_tokens == 3 * 10  # 3 rows padded to the longest
    assert est.activations == 30 * 2 * (6 * 8 + 2.5 * 32) * 4
    assert est.logits == 3 * 30 * 100 * 4
    assert (
        est.kv_slots == 8 and est.kv_cache == 8 * 2 * 2 * 2 * 4 * 10 * 4
    )  # rows in flight x layers x k,v x kv heads x dim x len
    packed = estimate_memory(
        config(trainer={"max_tokens_per_micro_batch": 64}, pipeline={"max_staleness": 2}), SHAPE, 10
    )
    assert packed.micro_batch_tokens == 64 and packed.kv_slots == 24
    assert (
        estimate_memory(config(trainer={"max_tokens_per_micro_batch": 64}), SHAPE, 100).micro_batch_tokens == 100
    )  # a longer row alone
    cached = estimate_memory(config(generator={"group_size": 4, "max_batch": 64, "prefix_cache_mb": 3}), SHAPE, 10)
    assert cached.kv_cache == est.kv_cache + 3 * 2**20  # the prefix cache's budget on top


def test_a_run_that_cannot_fit_is_refused_with_the_knob(tiny_policy):
    model = tiny_policy.model
    lines = []
    est = check_fits(config(), model, 64, lines.append, available=64 * GB)
    assert "memory estimate" in lines[0] and est.total < 64 * GB
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro_batch"):  # 8 rows x 2M tokens x vocab of logits
        check_fits(config(trainer={"micro_batch_size": 8}), model, 2_000_000, lines.append, available=64 * GB)
    with pytest.raises(ConfigError, match="generator.max_batch"):  # the KV cache of 4096 sequences
        check_fits(
            config(
                generator={"max_batch": 4096, "group_size": 64},
                loop={"prompts_per_step": 64},
                trainer={"max_tokens_per_micro_batch": 4096},
            ),
            model,
            32768,
            lines.append,
            available=8 * GB,
        )
