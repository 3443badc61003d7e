"""Multi-turn completions: tokens the environment wrote (tool output) are context, never trained.

`Completion.loss_mask` is copied into the batch's loss mask; every loss multiplies by it, so the
environment's tokens contribute exactly zero loss and zero gradient, whatever their log-probs."""

import copy

import pytest
import torch

from gapless.config import TrainerConfig
from gapless.trainer.batch import build_batch
from gapless.trainer.losses import LOSSES, dapo_loss
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import Completion

PAD = 0


def multi_turn(env_logprob: float = 0.0) -> Completion:
    """prompt [5, 6]; model turn [7, 8, 9]; tool output [10, 11]; model turn [12]."""
    lps = [-0.5, -1.0, -1.5, env_logprob, env_logprob, -2.0]
    return Completion([5, 6], [7, 8, 9, 10, 11, 12], lps, [3, 3, 3, 3, 3, 4], "stop", "", loss_mask=[1, 1, 1, 0, 0, 1])


def test_batch_copies_the_completion_loss_mask():
    single = Completion([5], [7, 8], [-0.1, -0.2], [0, 0], "stop", "")
    batch = build_batch([multi_turn(), single], [1.0, -1.0], [True, True], PAD, [0, 0])
    # row 0: positions 1..6 predict the completion's tokens (position t predicts token t + 1)
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0, 1]
    assert batch.loss_mask[1].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert batch.num_tokens == 6
    invalid = build_batch([multi_turn()], [1.0], [False], PAD)  # an infra failure trains nothing
    assert invalid.loss_mask.sum() == 0


def test_masked_tokens_contribute_exactly_zero_loss_and_gradient():
    batch = build_batch([multi_turn()], [2.0], [True], PAD)
    norm = StepNorm.of(batch.loss_mask, batch.group_ids, 8)
    logprobs = batch.behaviour_logprobs.clone().requires_grad_(True)  # (1, 7) ratio 1 everywhere
    out = dapo_loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.loss_mask, norm, 0.2, 0.2)
    loss = (out.per_token * out.weights).sum()
    loss.backward()
    # token mean over the 4 model tokens: sum_t -A * ratio_t / 4 = -2.0 * 4 / 4
    assert loss.item() == pytest.approx(-2.0)
    # d loss / d logprob_t = -A * ratio_t / 4 = -0.5 on model tokens, exactly 0 elsewhere
    assert logprobs.grad[0].tolist() == [0.0, -0.5, -0.5, -0.5, 0.0, 0.0, -0.5]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_environment_token_logprobs_do_not_change_the_model_gradient(tiny_policy, loss):
    """The same rollout with garbage behaviour log-probs on its tool-output tokens trains the
    model identically: those positions are outside every loss term and normaliser."""
    model = copy.deepcopy(tiny_policy.model)
    cfg = TrainerConfig(loss=loss, kl_coef=0.1, entropy_coef=0.01)
    grads = []
    for env_logprob in (0.0, -40.0):
        completions = [multi_turn(env_logprob), multi_turn(env_logprob)]
        batch = build_batch(completions, [1.0, -1.0], [True, True], PAD, [0, 0])
        trainer = GRPOTrainer(model, cfg, max_new_tokens=8)
        model.zero_grad(set_to_none=True)
        norm = StepNorm.of(batch.loss_mask, batch.group_ids, 8)
        trainer.accumulate_gradients(batch, norm, torch.zeros_like(batch.behaviour_logprobs))
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert any(bool(g.abs().sum() > 0) for g in grads[0])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
