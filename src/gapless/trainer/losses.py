"""GRPO policy loss: PPO-clipped, token-level, as pure functions of tensors.

Normalisation (DAPO-style token-level mean): the per-token losses of the whole step are summed
and divided by `num_tokens`, the number of completion tokens in the *whole step*. The caller
passes that step-wide count to every micro-batch, so accumulating micro-batch gradients equals
the gradient of one big batch. Masked positions (prompt, padding, excluded rollouts) contribute
exactly zero loss and zero gradient.

Per token t with ratio r = exp(logp - old_logp) and advantage A of its rollout:
    pg_t = -min(r * A, clip(r, 1 - eps, 1 + eps) * A)
    kl_t = exp(ref_logp - logp) - (ref_logp - logp) - 1        (k3 estimator, Schulman 2020)
    loss = sum_t mask_t * (pg_t + kl_coef * kl_t) / num_tokens
"""

from __future__ import annotations

import torch


def grpo_token_loss(
    logprobs: torch.Tensor,  # (B, T) trainer log-probs, with gradient
    old_logprobs: torch.Tensor,  # (B, T) behaviour log-probs from the generator
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1 for completion tokens that count
    num_tokens: int,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,  # (B, T)
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    stats = {}
    if kl_coef > 0.0:
        assert ref_logprobs is not None, "kl_coef > 0 needs ref_logprobs"
        delta = (ref_logprobs - logprobs) * mask
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl_sum"] = (kl * mask).sum().item()
    loss = (per_token * mask).sum() / max(num_tokens, 1)
    with torch.no_grad():
        stats["clip_count"] = ((unclipped != clipped).to(mask.dtype) * mask).sum().item()
        stats["ratio_sum"] = (ratio * mask).sum().item()
    return loss, stats
