"""Token-budget micro-batches, the packed forward and the chunked LM head: the same log-probs as
the padded forward (1e-5) and the same step gradient as the plain step (1e-6, in float64), and
masked tokens contribute nothing."""

import copy

import pytest
import torch

from gapless.config import ModelConfig, TrainerConfig
from gapless.models import build_tiny
from gapless.trainer.batch import Batch, token_logprobs_and_entropy
from gapless.trainer.chunked_head import head_logprobs
from gapless.trainer.micro_batches import token_budget_rows
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.packing import pack, packed_logprobs_and_entropy
from gapless.trainer.trainer import GRPOTrainer

LENGTHS = [9, 23, 14, 5, 31, 17]  # tokens per row, prompt (4 tokens) included
PROMPT = 4


def test_token_budget_rows_cover_every_row_once_sorted_and_bounded():
    lengths = [5, 40, 7, 7, 12, 3, 100]
    cuts = token_budget_rows(lengths, 30)
    assert sorted(r for rows in cuts for r in rows) == list(range(len(lengths)))
    flat = [lengths[r] for rows in cuts for r in rows]
    assert flat == sorted(lengths)
    assert cuts == [[5, 0, 2, 3], [4], [1], [6]]  # 3+5+7+7 = 22, +12 > 30; 40 and 100 alone (over the budget)
    assert all(sum(lengths[r] for r in rows) <= 30 or len(rows) == 1 for rows in cuts)


def test_pack_restarts_positions_per_row():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    packed, positions, offsets = pack(ids, mask)
    assert (
        packed.tolist() == [[5, 6, 7, 8, 9]] and positions.tolist() == [[0, 1, 2, 0, 1]] and offsets.tolist() == [0, 3]
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_log_softmax_values_and_gradients(temperature):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=gen)
    g, h = torch.randn(11, generator=gen, dtype=torch.float64), torch.randn(11, generator=gen, dtype=torch.float64)
    picked, entropy = head_logprobs(hidden, weight, bias, targets, temperature, chunk=4)  # 3 chunks, the last short
    ((picked * g).sum() + (entropy * h).sum()).backward()
    mine = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    theirs, their_entropy = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((theirs * g).sum() + (their_entropy * h).sum()).backward()
    assert torch.allclose(picked, theirs, atol=1e-12) and torch.allclose(entropy, their_entropy, atol=1e-12)
    for a, t in zip(mine, (hidden, weight, bias)):
        assert torch.allclose(a, t.grad, atol=1e-12)


def tiny(architecture: str = "qwen2") -> torch.nn.Module:
    cfg = ModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        vocab_size=300,
        architecture=architecture,
    )
    return build_tiny(cfg, ["12 + 34 = 46; 7 * 8 = 56"] * 8, seed=0).model


def rows(vocab: int, dtype=torch.float32) -> Batch:
    """Right-padded rows of LENGTHS tokens; the completions (after PROMPT tokens) train, row 3 not at all."""
    gen = torch.Generator().manual_seed(3)
    width, n = max(LENGTHS), len(LENGTHS)
    ids = torch.randint(3, vocab, (n, width), generator=gen)
    attention = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width - 1)
    for row, length in enumerate(LENGTHS):
        attention[row, :length] = 1
        ids[row, length:] = 0
        loss_mask[row, PROMPT - 1 : length - 1] = float(row != 3)
    behaviour = (-2.0 - torch.rand(n, width - 1, generator=gen)) * loss_mask
    advantages = torch.randn(n, generator=gen)
    return Batch(ids, attention, loss_mask, behaviour, advantages, torch.tensor([0, 0, 0, 1, 1, 1]))


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])  # mistral: a 16-token sliding window, crossed here
def test_packed_forward_equals_the_padded_forward(architecture):
    model = tiny(architecture)
    batch = rows(model.config.vocab_size)
    need = batch.loss_mask != 0
    padded, padded_entropy = token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask, 0.8)
    packed, packed_entropy = packed_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask, need, 0.8)
    assert torch.allclose(packed[need], padded[need], atol=1e-5)
    assert torch.allclose(packed_entropy[need], padded_entropy[need], atol=1e-5)
    assert (packed[~need] == 0).all() and (packed_entropy[~need] == 0).all()
    # rows must not see each other: packing them as one sequence with running positions would change them
    ids, _, _ = pack(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        joined = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / 0.8, -1).gather(-1, ids[0, 1:, None])[:, 0]
    rows_, cols = need.nonzero(as_tuple=True)
    offsets = torch.cumsum(torch.tensor(LENGTHS), 0) - torch.tensor(LENGTHS)
    leaked = joined[offsets[rows_] + cols]
    assert float((leaked - packed.detach()[need]).abs().max()) > 1e-4


def step_gradients(model, batch: Batch, cfg: TrainerConfig) -> list[torch.Tensor]:
    trainer = GRPOTrainer(model, cfg, temperature=0.7, max_new_tokens=32)
    model.zero_grad(set_to_none=True)
    start = torch.zeros_like(batch.loss_mask, dtype=next(model.parameters()).dtype)
    trainer.accumulate_gradients(batch, StepNorm.of(batch.loss_mask, batch.group_ids, 32), start)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


VARIANTS = [
    {"loss": "dapo"},
    {"loss": "grpo", "entropy_coef": 0.01, "kl_coef": 0.05},
    {"loss": "gspo", "old_logprobs": "trainer", "correction": "tis", "correction_level": "sequence"},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v["loss"])
def test_packed_chunked_step_gives_the_plain_step_gradient(variant, monkeypatch):
    model = tiny().double()
    batch = rows(model.config.vocab_size)
    monkeypatch.setattr("gapless.trainer.chunked_head.LOGITS_CHUNK_BYTES", 16 * 2 * 4 * 300)  # 16-position chunks
    plain = step_gradients(model, batch, TrainerConfig(micro_batch_size=len(batch), **variant))
    packed = step_gradients(
        model, batch, TrainerConfig(max_tokens_per_micro_batch=40, **variant)
    )  # rows 5+9+14 | 17+23 | 31
    assert len(batch.cut(1, 40)) == 3 and max(len(i) for i, _ in batch.cut(1, 40)) == 3
    for a, b in zip(plain, packed):
        assert torch.allclose(a, b, rtol=0, atol=1e-6 * max(1.0, float(a.abs().max())))
    assert sum(float(g.abs().sum()) for g in plain) > 0


def test_masked_tokens_contribute_nothing_to_the_packed_step():
    model = tiny().double()
    batch = rows(model.config.vocab_size)
    cfg = TrainerConfig(max_tokens_per_micro_batch=40, entropy_coef=0.01)
    base = step_gradients(copy.deepcopy(model), batch, cfg)
    masked = batch.loss_mask == 0
    noisy = copy.copy(batch)
    noisy.behaviour_logprobs = batch.behaviour_logprobs + 5.0 * masked  # what masked positions "sampled"
    noisy.advantages = batch.advantages.clone()
    noisy.advantages[3] = 100.0  # row 3 trains on nothing
    for a, b in zip(base, step_gradients(copy.deepcopy(model), noisy, cfg)):
        assert torch.equal(a, b)
