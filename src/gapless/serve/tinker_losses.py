"""The Tinker SDK's built-in losses, as pure functions of one datum's tensors.

Every loss takes `logprobs`, the trainer's log p(target_tokens[t] | input[:t+1]) with gradient,
shape (T,), the datum's other `loss_fn_inputs` as float tensors (T,), and the request's
`loss_fn_config`, and returns the datum's loss. The service sums the losses over the datums
(Tinker's convention: `loss:sum`, no mean anywhere, so the learning rate scales with the number
of tokens), backpropagates the sum and returns each datum's `logprobs` (no gradient).

    cross_entropy        -sum_t w_t * logp_t                       (w = `weights`, default 1)
    importance_sampling  -sum_t (p_t / q_t) * A_t                  (q = sampler's `logprobs`, A = `advantages`)
    ppo                  -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)   r_t = p_t / q_t (Schulman et al. 2017)
    cispo                -sum_t sg(clip(r_t, lo, hi)) * logp_t * A_t  (MiniMax-M1, Chen et al. 2025)

with lo, hi = `clip_low_threshold`, `clip_high_threshold` from the config (default 0.8 and 1.2,
Tinker's fixed epsilon of 0.2). Not provided: `dro`, `gspo`, `stable_reinforce` and server-side
`custom` losses; asking for one is a user error naming the supported losses (the SDK's
`forward_backward_custom` runs client-side and works: it reaches the service as `cross_entropy`).
"""

from __future__ import annotations

from typing import Callable

import torch

Inputs = dict[str, torch.Tensor]


class LossInputError(ValueError):
    """A datum whose loss inputs do not fit the loss (missing or mis-shaped tensor, unknown loss)."""


def _need(inputs: Inputs, name: str, length: int, loss: str) -> torch.Tensor:
    if name not in inputs:
        raise LossInputError(f"loss {loss!r} needs loss_fn_inputs[{name!r}] (one value per target token)")
    tensor = inputs[name]
    if tensor.shape != (length,):
        raise LossInputError(f"loss_fn_inputs[{name!r}] has shape {tuple(tensor.shape)}; it must match "
                             f"target_tokens, shape ({length},)")
    return tensor


def cross_entropy(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    weights = _need(inputs, "weights", len(logprobs), "cross_entropy") if "weights" in inputs else torch.ones_like(logprobs)
    return -(weights * logprobs).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "importance_sampling")
    advantages = _need(inputs, "advantages", len(logprobs), "importance_sampling")
    return -(torch.exp(logprobs - sampled) * advantages).sum()


def _clip_range(config: dict[str, float]) -> tuple[float, float]:
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if not 0 <= lo <= 1 <= hi:
        raise LossInputError(f"clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold "
                             f"(got {lo}, {hi})")
    return lo, hi


def ppo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "ppo")
    advantages = _need(inputs, "advantages", len(logprobs), "ppo")
    lo, hi = _clip_range(config)
    ratio = torch.exp(logprobs - sampled)
    return -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages).sum()


def cispo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "cispo")
    advantages = _need(inputs, "advantages", len(logprobs), "cispo")
    lo, hi = _clip_range(config)
    ratio = torch.exp(logprobs - sampled).clamp(lo, hi).detach()
    return -(ratio * logprobs * advantages).sum()


LOSSES: dict[str, Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo,
}


def loss_fn(name: str) -> Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]:
    if name not in LOSSES:
        raise LossInputError(f"loss_fn {name!r} is not served here; this service provides {', '.join(LOSSES)} "
                             "(use forward_backward_custom for anything else)")
    return LOSSES[name]
