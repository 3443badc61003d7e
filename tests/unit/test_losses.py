import math

import pytest
import torch

from gapless.trainer.losses import grpo_token_loss


def test_clipped_loss_matches_hand_computation():
    # Two sequences, two completion tokens each (second sequence's 2nd token masked out).
    # seq 0, A = +1: ratios exp(log 1.5) = 1.5 and exp(log 0.5) = 0.5
    #   token 0: min(1.5 * 1, clip(1.5) * 1 = 1.2) = 1.2   -> loss -1.2
    #   token 1: min(0.5 * 1, clip(0.5) * 1 = 0.8) = 0.5   -> loss -0.5
    # seq 1, A = -2: ratio 1.1 (inside the clip range) -> min(-2.2, -2.2) -> loss +2.2
    # total = (-1.2 - 0.5 + 2.2) / 3 tokens = 0.5 / 3
    old = torch.zeros(2, 2)
    new = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = grpo_token_loss(new, old, adv, mask, num_tokens=3, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 / 3, abs=1e-6)
    assert stats["clip_count"] == 2.0  # tokens 0 and 1 of seq 0 are clipped
    loss.backward()
    grad = new.grad
    # token 0 of seq 0 is clipped on the profitable side: no gradient
    assert grad[0, 0] == 0.0
    # token 1 of seq 0: d(-r * A)/d logp / 3 = -0.5 / 3
    assert float(grad[0, 1]) == pytest.approx(-0.5 / 3, abs=1e-6)
    # seq 1 token 0: d(-r * A)/d logp / 3 = 2.2 / 3
    assert float(grad[1, 0]) == pytest.approx(2.2 / 3, abs=1e-6)
    # masked token: exactly zero gradient even with an extreme log-prob
    assert grad[1, 1] == 0.0


def test_on_policy_gradient_is_advantage_weighted_score():
    # ratio 1 everywhere: loss = -sum(A) / n, gradient wrt logp = -A / n per token
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = grpo_token_loss(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2), num_tokens=2)
    assert loss.item() == pytest.approx(-0.5, abs=1e-7)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.25, -0.25])


def test_k3_kl_penalty():
    # delta = ref - logp = log(0.5): k3 = 0.5 - log(0.5) - 1 = 0.193147; A = 0 so only KL counts
    logp = torch.tensor([[0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.5)]])
    loss, stats = grpo_token_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 1), 1, kl_coef=0.1, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1), abs=1e-7)
    # d k3 / d logp = -exp(delta) + 1 = 0.5, times 0.1
    loss.backward()
    assert float(logp.grad) == pytest.approx(0.05, abs=1e-7)


def test_micro_batches_sum_to_the_full_batch_gradient():
    torch.manual_seed(0)
    logp = torch.randn(6, 5, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(6, 5)
    adv = torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).float()
    n = int(mask.sum())
    full, _ = grpo_token_loss(logp, old, adv, mask, n)
    (g_full,) = torch.autograd.grad(full, logp)
    g_micro = torch.zeros_like(logp)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, _ = grpo_token_loss(logp[rows], old[rows], adv[rows], mask[rows], n)
        (g,) = torch.autograd.grad(part, logp)
        g_micro += g
    assert torch.allclose(g_full, g_micro, atol=1e-7)
