"""Every policy loss against values computed by hand, its gradient, and micro-batch exactness.

The shared example: three sequences, T = 3, clip range [0.8, 1.2], max_new_tokens = 4.
    seq 0, group 0, A = +1:   log-probs -0.5, -1.0, -2.0   ratios 1.5, 0.5, 1.0
    seq 1, group 0, A = -2:   log-prob  -1.0 (+ 2 masked)  ratio  1.1
    seq 2, group 1, A = +0.5: log-probs -0.5, -1.0 (+ 1 masked)  ratios e^0.1 = 1.105171, e^0.3 = 1.349859
Masked positions hold log-prob 5.0 and old log-prob -3.0: they must change nothing.
Counts: 6 loss tokens, 3 sequences, 2 groups (sizes 2 and 1), 3 rows.

PPO-clip per token, l = -min(r A, clip(r) A):
    seq 0: r 1.5 -> min(1.5, 1.2) = 1.2 -> -1.2 (clipped)  r 0.5 -> min(0.5, 0.8) -> -0.5   r 1 -> -1.0
    seq 1: r 1.1 (inside) -> -(1.1 * -2) = +2.2
    seq 2: r 1.105171 -> -0.552585     r 1.349859 -> min(0.674929, 0.6) -> -0.6 (clipped)
Gradient d l / d logp = -r A where the unclipped branch is active, 0 where the clip bit:
    seq 0: 0, -0.5, -1.0    seq 1: +2.2    seq 2: -0.552585, 0
"""

import math

import pytest
import torch

from gapless.trainer.losses import LOSSES, cispo_loss, dapo_loss, drgrpo_loss, grpo_loss, gspo_loss
from gapless.trainer.normalisers import StepNorm

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
LOGP = [[-0.5, -1.0, -2.0], [-1.0, 5.0, 5.0], [-0.5, -1.0, 5.0]]
LOG_RATIO = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.1), 0.0, 0.0], [0.1, 0.3, 0.0]])
ADV = torch.tensor([1.0, -2.0, 0.5])
GROUPS = torch.tensor([0, 0, 1])
PPO_TERMS = torch.tensor([[-1.2, -0.5, -1.0], [2.2, 0.0, 0.0], [-0.552585, -0.6, 0.0]])
PPO_SCORE_GRAD = torch.tensor([[0.0, -0.5, -1.0], [2.2, 0.0, 0.0], [-0.552585, 0.0, 0.0]])


def example(clip_high: float = 0.2, loss=dapo_loss):
    logp = torch.tensor(LOGP, requires_grad=True)
    old = torch.where(MASK > 0, logp.detach() - LOG_RATIO, torch.full_like(LOG_RATIO, -3.0))
    norm = StepNorm.of(MASK, GROUPS, max_new_tokens=4)
    out = loss(logp, old, ADV, MASK, norm, 0.2, clip_high)
    (grad,) = torch.autograd.grad(out.total, logp)
    return out, grad


def test_step_norm_counts():
    norm = StepNorm.of(MASK, GROUPS, max_new_tokens=4)
    assert (norm.num_tokens, norm.num_sequences, norm.num_groups, norm.num_rows) == (6, 3, 2, 3)
    assert norm.group_sizes.tolist() == [2.0, 2.0, 1.0]
    # a row without loss tokens (an infrastructure failure) leaves its group's size and the counts
    mask = MASK.clone()
    mask[1] = 0.0
    norm = StepNorm.of(mask, GROUPS, max_new_tokens=4)
    assert (norm.num_tokens, norm.num_sequences, norm.num_groups) == (5, 2, 2)
    assert norm.group_sizes.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "loss, total, weights",
    [
        # DAPO token mean: (-1.2 - 0.5 - 1.0 + 2.2 - 0.552585 - 0.6) / 6 = -1.652585 / 6 = -0.275431
        (dapo_loss, -1.652585 / 6, [1 / 6] * 3),
        # GRPO paper: seq 0 -> 1/(3 tok * 2 seqs * 2 groups) = 1/12; seq 1 -> 1/(1 * 2 * 2) = 1/4;
        # seq 2 -> 1/(2 * 1 * 2) = 1/4.  -2.7/12 + 2.2/4 - 1.152585/4 = -0.225 + 0.55 - 0.288146 = 0.036854
        (grpo_loss, 0.036854, [1 / 12, 1 / 4, 1 / 4]),
        # Dr. GRPO: constant 3 rows * 4 max_new_tokens = 12: -1.652585 / 12 = -0.137715
        (drgrpo_loss, -1.652585 / 12, [1 / 12] * 3),
    ],
)
def test_ppo_clip_losses_match_hand_computation(loss, total, weights):
    out, grad = example(loss=loss)
    on = MASK > 0
    assert torch.allclose(out.per_token[on], PPO_TERMS[on], atol=1e-6)
    assert out.total.item() == pytest.approx(total, abs=1e-6)
    row_weight = torch.tensor(weights)[:, None] * MASK
    assert torch.allclose(out.weights, row_weight, atol=1e-7)
    # gradient = -r A * weight where the clip does not bite, exactly 0 where it does
    assert torch.allclose(grad, PPO_SCORE_GRAD * row_weight, atol=1e-6)
    assert grad[0, 0] == 0.0 and grad[2, 1] == 0.0
    assert out.is_clipped[on].tolist() == [True, True, False, False, False, True]


def test_dapo_clip_higher():
    # upper bound 1.28: seq 0 token 0 -> -min(1.5, 1.28) = -1.28; seq 2 token 1 -> -min(0.674929, 0.64) = -0.64
    # total = (-1.28 - 0.5 - 1.0 + 2.2 - 0.552585 - 0.64) / 6 = -1.772585 / 6 = -0.295431
    out, grad = example(clip_high=0.28)
    assert out.total.item() == pytest.approx(-1.772585 / 6, abs=1e-6)
    assert grad[0, 0] == 0.0  # still clipped above 1.28


def verl_dual_clip(ratio, adv, lo, hi, c):
    """verl's `compute_policy_loss_vanilla` per-token loss, written from its formula: the PPO-clip
    maximum of -A r and -A clip(r), then for A < 0 the minimum of that and -A c."""
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.minimum(-adv * c, clip1)
    return torch.where(adv < 0, clip2, clip1)


@pytest.mark.parametrize("loss", [dapo_loss, grpo_loss, drgrpo_loss])
def test_dual_clip_matches_verl(loss):
    # one row per case, A = -1 unless noted; c = 3:
    #   r = 5   (A < 0): PPO term -(-1) * 5 = 5, capped at 3 * 1 = 3, no gradient
    #   r = 2.5 (A < 0): 2.5 < 3, unchanged, gradient -r A = 2.5
    #   r = 5   (A = +1): the dual clip never applies to A > 0: -min(5, 1.2) = -1.2 (ordinary clip)
    #   r = 0.5 (A < 0): -max(... ) = 0.8 (clipped below), below the cap
    ratio = torch.tensor([[5.0], [2.5], [5.0], [0.5]])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    logp = torch.zeros(4, 1, requires_grad=True)
    old = -torch.log(ratio)
    norm = StepNorm.of(mask, torch.arange(4), max_new_tokens=1)
    out = loss(logp, old, adv, mask, norm, 0.2, 0.2, dual_clip_c=3.0)
    want = verl_dual_clip(ratio, adv[:, None], 0.2, 0.2, 3.0)
    assert torch.allclose(out.per_token, want, atol=1e-6)
    assert out.per_token.flatten().tolist() == pytest.approx([3.0, 2.5, -1.2, 0.8], abs=1e-6)
    (grad,) = torch.autograd.grad(out.total, logp)
    assert grad[0, 0] == 0.0 and grad[2, 0] == 0.0 and grad[3, 0] == 0.0
    assert grad[1, 0].item() == pytest.approx(2.5 * out.weights[1, 0].item(), abs=1e-6)
    assert out.is_clipped[0, 0]  # the dual clip counts as a clip
    # off by default: the capped token keeps its full PPO-clip loss
    plain = loss(logp, old, adv, mask, norm, 0.2, 0.2)
    assert plain.per_token[0, 0].item() == pytest.approx(5.0, abs=1e-6)


def test_gspo_sequence_ratio():
    # s_0 = exp(mean(log 1.5, log 0.5, 0)) = 0.75^(1/3) = 0.908560, A = 1 -> l_0 = -0.908560 (not clipped)
    # s_1 = 1.1, A = -2 -> l_1 = +2.2;  s_2 = exp((0.1 + 0.3) / 2) = e^0.2 = 1.221403, A = 0.5
    #   -> min(0.610701, 1.2 * 0.5 = 0.6) = 0.6 -> l_2 = -0.6 (clipped)
    # total = mean over 3 sequences = (-0.908560 + 2.2 - 0.6) / 3 = 0.230480
    out, grad = example(loss=gspo_loss)
    assert out.total.item() == pytest.approx(0.691440 / 3, abs=1e-6)
    assert torch.allclose(out.per_token[0], torch.full((3,), -0.908560), atol=1e-6)
    assert out.ratio[2, 0].item() == pytest.approx(math.exp(0.2), abs=1e-6)
    # d total / d logp_t = (1/3) * (-A s / |o|): every token of a sequence gets the same share
    #   seq 0: -0.908560 / 3 / 3 = -0.100951 each;  seq 1: 2.2 / 3 = 0.733333;  seq 2 clipped: 0
    assert torch.allclose(grad[0], torch.full((3,), -0.100951), atol=1e-6)
    assert grad[1, 0].item() == pytest.approx(0.733333, abs=1e-6)
    assert torch.equal(grad[2], torch.zeros(3))
    assert grad[1, 1] == 0.0 and grad[1, 2] == 0.0


def test_cispo_clipped_weight_is_stop_gradient():
    # w = clip(r, 0.8, 1.2): seq 0 [1.2, 0.8, 1.0], seq 1 [1.1], seq 2 [1.105171, 1.2]
    # l = -w A logp: seq 0 (A=1): -1.2*-0.5 = 0.6, -0.8*-1 = 0.8, -1*-2 = 2.0
    #   seq 1 (A=-2, logp -1): -1.1 * -2 * -1 = -2.2
    #   seq 2 (A=0.5): -1.105171*0.5*-0.5 = 0.276293, -1.2*0.5*-1 = 0.6
    # total = (0.6 + 0.8 + 2.0 - 2.2 + 0.276293 + 0.6) / 6 = 2.076293 / 6 = 0.346049
    out, grad = example(loss=cispo_loss)
    on = MASK > 0
    assert torch.allclose(out.per_token[on], torch.tensor([0.6, 0.8, 2.0, -2.2, 0.276293, 0.6]), atol=1e-6)
    assert out.total.item() == pytest.approx(2.076293 / 6, abs=1e-6)
    # gradient = -w A / 6, clipped tokens included (unlike PPO-clip): w gets no gradient.
    # Without the stop-gradient, seq 0 token 2 (w = r = 1, logp = -2) would get
    # -(r + r logp) A / 6 = +1/6 instead of -1/6.
    expected = torch.tensor([[-1.2, -0.8, -1.0], [2.2, 0.0, 0.0], [-0.552585, -0.6, 0.0]]) / 6
    assert torch.allclose(grad, expected, atol=1e-6)
    assert grad[0, 2].item() == pytest.approx(-1 / 6, abs=1e-7)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_tokens_contribute_nothing(name):
    # the same example with wild values at masked positions gives the same loss and gradient,
    # and exactly zero gradient there
    out, grad = example(loss=LOSSES[name])
    logp = torch.tensor(LOGP, requires_grad=True)
    with torch.no_grad():
        logp[MASK == 0] = -50.0
    old = torch.where(MASK > 0, logp.detach() - LOG_RATIO, torch.full_like(LOG_RATIO, 40.0))
    wild = LOSSES[name](logp, old, ADV, MASK, StepNorm.of(MASK, GROUPS, 4), 0.2, 0.2)
    (wild_grad,) = torch.autograd.grad(wild.total, logp)
    assert wild.total.item() == pytest.approx(out.total.item(), abs=1e-6)
    assert torch.equal(wild_grad[MASK == 0], torch.zeros(3))
    assert torch.allclose(wild_grad, grad, atol=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_gradient_is_advantage_weighted_score(name):
    # ratio 1 everywhere: every loss's gradient is -A * (its weight) per token; for GSPO the
    # weight of a token is 1/(|o| * sequences), which is what its sequence-ratio gradient gives
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.ones(2, 2)
    norm = StepNorm.of(mask, torch.tensor([0, 0]), max_new_tokens=2)
    out = LOSSES[name](logp, logp.detach(), torch.tensor([0.5, -1.0]), mask, norm, 0.2, 0.2)
    (grad,) = torch.autograd.grad(out.total, logp)
    # every aggregation gives each of the 4 tokens weight 1/4 here (equal lengths, one group, 2 rows * 2)
    assert torch.allclose(grad, torch.tensor([[-0.125, -0.125], [0.25, 0.25]]), atol=1e-7)
    assert out.ratio.tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_sum_to_the_full_batch_gradient(name):
    torch.manual_seed(0)
    logp = torch.randn(7, 5, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(7, 5)
    adv = torch.randn(7)
    mask = (torch.rand(7, 5) > 0.3).float()
    mask[4] = 0.0  # a row without loss tokens
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])  # the splits below cut through groups
    norm = StepNorm.of(mask, groups, max_new_tokens=5)
    full = LOSSES[name](logp, old, adv, mask, norm, 0.2, 0.28)
    (g_full,) = torch.autograd.grad(full.total, logp)
    g_micro, total = torch.zeros_like(logp), 0.0
    for start, stop in ((0, 2), (2, 3), (3, 7)):
        rows = slice(start, stop)
        part = LOSSES[name](logp[rows], old[rows], adv[rows], mask[rows], norm.select(rows), 0.2, 0.28)
        (g,) = torch.autograd.grad(part.total, logp)
        g_micro += g
        total += part.total.item()
    assert torch.allclose(g_full, g_micro, atol=1e-7)
    assert total == pytest.approx(full.total.item(), abs=1e-6)
