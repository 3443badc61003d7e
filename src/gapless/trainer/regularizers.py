"""Regularisers added to the policy loss: KL to a frozen reference, and an entropy bonus.

KL estimators (Schulman 2020, "Approximating KL divergence"), per token, with samples from the
policy p and delta = log p_ref - log p:
    k1 = -delta                      unbiased, can be negative, high variance
    k3 = exp(delta) - delta - 1      unbiased, never negative, low variance (GRPO paper)
As a loss term the KL is averaged with the policy loss's own weights (trainer.py); folded into
the reward it is summed over a completion's tokens and subtracted from that rollout's reward
before the group baseline (groups.py). The entropy of each next-token distribution comes with
the log-probs (batch.token_logprobs_and_entropy); the loss subtracts entropy_coef times it.
Masked positions give 0 whatever their log-probs.
"""

from __future__ import annotations

import torch


def token_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token KL(p || p_ref) estimate, (B, T); 0 where masked."""
    delta = (ref_logprobs - logprobs) * mask
    if estimator == "k1":
        return -delta
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1' or 'k3'")


def sequence_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """KL of each whole completion, the sum of its per-token estimates, (B,)."""
    return (token_kl(logprobs, ref_logprobs, mask, estimator) * mask).sum(-1)
