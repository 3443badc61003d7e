"""Policy losses of the GRPO family, as pure functions of tensors.

Every loss takes the trainer's log-probs (with gradient), the PPO "old" log-probs (no gradient;
behaviour or trainer-at-step-start, see trainer.py), one advantage per sequence, the loss mask and
the step's normaliser (normalisers.py), and returns a `PolicyLoss`: the per-token loss, the
per-token weights that average it into the step loss, and clip diagnostics. Regularisers and
off-policy corrections are composed by the trainer on top of `per_token`, with the same weights.

With ratio r_t = exp(logp_t - old_t), advantage A of the token's sequence, clip range
[1 - lo, 1 + hi] (hi = lo unless clip-higher is set):
    PPO-clip term   l_t = -min(r_t * A, clip(r_t) * A)
    dual-clip       l_t = min(l_t, -c * A)  for A < 0 only (Ye et al. 2020), with c = dual_clip_c > 1:
                    a token with a negative advantage and a huge ratio (common in stale rollouts)
                    has its loss bounded by c * |A| and gives no gradient. Off (None) by default.
Masked positions (prompt, padding, excluded rollouts) get weight 0: they contribute exactly zero
loss and zero gradient, whatever their log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gapless.trainer.normalisers import StepNorm, constant, seq_group_mean, seq_mean, token_mean


@dataclass
class PolicyLoss:
    per_token: torch.Tensor  # (B, T) loss of each token before averaging
    weights: torch.Tensor  # (B, T) step loss = sum(weights * per_token); 0 where masked
    ratio: torch.Tensor  # (B, T) the ratio the loss used, no gradient (for metrics)
    is_clipped: torch.Tensor  # (B, T) bool, the clip changed the token's term

    @property
    def total(self) -> torch.Tensor:
        return (self.per_token * self.weights).sum()


def ppo_clip_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss (dual-clipped if `dual_clip_c`), its ratio and where a clip bit. All (B, T)."""
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logprobs.dtype).expand_as(ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = unclipped != clipped
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv  # > 0 where A < 0
        is_dual = (adv < 0) & (loss > bound)
        loss = torch.where(is_dual, bound, loss)
        is_clipped = is_clipped | is_dual
    return loss, ratio.detach(), is_clipped


def dapo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    norm: StepNorm,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """DAPO (Yu et al. 2025): PPO-clip with decoupled bounds [1 - clip_low, 1 + clip_high].

    Normalisation: token-level mean over the whole step -- the sum of every loss token's term
    divided by the number of loss tokens in the step, so each token weighs the same whatever the
    length of its sequence. With clip_high = clip_low this is plain token-level GRPO (the default).
    """
    mask = mask.to(logprobs.dtype)
    per_token, ratio, is_clipped = ppo_clip_terms(
        logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip_c
    )
    return PolicyLoss(per_token, token_mean(mask, norm), ratio, is_clipped)


def grpo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    norm: StepNorm,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """GRPO as in DeepSeekMath (Shao et al. 2024): PPO-clip per token.

    Normalisation: mean over each sequence's tokens, then mean over the sequences of its group,
    then mean over the groups of the step (1/G sum_i 1/|o_i| sum_t). A token of a long completion
    weighs less than one of a short completion: the length bias Dr. GRPO points out.
    """
    mask = mask.to(logprobs.dtype)
    per_token, ratio, is_clipped = ppo_clip_terms(
        logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip_c
    )
    return PolicyLoss(per_token, seq_group_mean(mask, norm), ratio, is_clipped)


def drgrpo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    norm: StepNorm,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): PPO-clip per token.

    Normalisation: the sum over all loss tokens divided by a constant, rows in the step times
    max_new_tokens, independent of the generated lengths (no length bias; pair with
    advantage = 'drgrpo' for the paper's recipe).
    """
    mask = mask.to(logprobs.dtype)
    per_token, ratio, is_clipped = ppo_clip_terms(
        logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip_c
    )
    return PolicyLoss(per_token, constant(mask, norm), ratio, is_clipped)


def gspo_loss(
    logprobs, old_logprobs, advantages, mask, norm: StepNorm, clip_low: float, clip_high: float
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025): PPO-clip on a sequence-level, length-normalised ratio.

    s_i = exp(mean_t (logp_t - old_t)) over sequence i's loss tokens (a geometric mean of its
    token ratios); l_i = -min(s_i * A_i, clip(s_i) * A_i). The gradient reaches every token of the
    sequence through s_i, equally; a clipped sequence gives none. Each token carries its
    sequence's l_i. Normalisation: mean over each sequence's tokens, then over the step's
    sequences (= the mean of l_i over sequences).
    """
    mask = mask.to(logprobs.dtype)
    row_tokens = mask.sum(-1).clamp(min=1)  # (B,)
    seq_ratio = torch.exp(((logprobs - old_logprobs) * mask).sum(-1) / row_tokens)  # (B,)
    adv = advantages.to(logprobs.dtype)
    unclipped = seq_ratio * adv
    clipped = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    seq_loss = -torch.minimum(unclipped, clipped)  # (B,)
    per_token = seq_loss[:, None].expand_as(mask)
    is_clipped = (unclipped != clipped)[:, None].expand_as(mask)
    return PolicyLoss(per_token, seq_mean(mask, norm), seq_ratio.detach()[:, None].expand_as(mask), is_clipped)


def cispo_loss(
    logprobs, old_logprobs, advantages, mask, norm: StepNorm, clip_low: float, clip_high: float
) -> PolicyLoss:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A * logp_t. Unlike PPO-clip, a clipped
    token still gives gradient (scaled by the clipped weight), so rare high-ratio tokens keep
    learning. The paper puts no lower bound on the weight (set clip_eps close to 1) and tunes
    only the upper one. Normalisation: token-level mean over the whole step, as DAPO.
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    per_token = -weight * advantages[:, None].to(logprobs.dtype) * (logprobs * mask)
    return PolicyLoss(per_token, token_mean(mask, norm), ratio.detach(), weight != ratio.detach())


PolicyLossFn = Callable[..., PolicyLoss]
PPO_CLIP_LOSSES = ("dapo", "grpo", "drgrpo")  # the token-level PPO-clip family: the ones dual-clip applies to
LOSSES: dict[str, PolicyLossFn] = {
    "dapo": dapo_loss,
    "grpo": grpo_loss,
    "drgrpo": drgrpo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
