"""The Tinker SDK's built-in losses, as pure functions of one datum's tensors.

Every loss takes `logprobs`, the trainer's log p(target_tokens[t] | input[:t+1]) with gradient,
shape (T,), the datum's other `loss_fn_inputs` as float tensors (T,), and the request's
`loss_fn_config` (numbers from `loss_fn_config_v2`, else the legacy map), and returns the datum's
loss. The service sums the losses over the datums (Tinker's convention: `loss:sum`, no mean
anywhere, so the learning rate scales with the number of tokens), backpropagates the sum and
returns each datum's `logprobs` (no gradient). With p_t = exp(logp_t), q_t the sampler's
probability (`logprobs` input), A_t = `advantages`, sg = stop-gradient, lo/hi the clip range:

    cross_entropy        -sum_t w_t * logp_t                       (w = `weights`, default 1)
                         with target_tokens and weights (T, K), top-k distillation:
                         -sum_t sum_k w_tk * log p(target_tk | input[:t+1]), logprobs (T, K) back
    importance_sampling  -sum_t (p_t / q_t) * A_t
    ppo                  -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)   r_t = p_t / q_t (Schulman et al. 2017)
    cispo                -sum_t sg(clip(r_t, lo, hi)) * logp_t * A_t  (MiniMax-M1, Chen et al. 2025)
    dro                  -sum_t (logp_t A_t - beta/2 (logp_t - log q_t)^2)
                         (Richemond et al. 2024; `beta` from the config, required)
    gspo                 ppo with r_t replaced by s_t = sg(s) * p_t / sg(p_t), where
                         s = exp(mean_{t in M} (logp_t - log q_t)) over the tokens M that
                         `sequence_ratio_mask` marks (GSPO-token, Zheng et al. 2025): every token
                         carries the sequence ratio's value and its own log-prob's gradient

lo, hi = `clip_low_threshold`, `clip_high_threshold` from the config (default 0.8 and 1.2,
Tinker's fixed epsilon of 0.2). The formulas are Tinker's documented ones (docs/service.md names
the page of each). Not provided: `stable_reinforce`, whose objective Tinker does not publish, and
server-side `custom` losses; asking for one is a user error that says so and names the served
losses (the SDK's `forward_backward_custom` runs client-side and works: it reaches the service as
`cross_entropy`).
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
        raise LossInputError(
            f"loss_fn_inputs[{name!r}] has shape {tuple(tensor.shape)}; it must match target_tokens, shape ({length},)"
        )
    return tensor


def cross_entropy(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """Also top-k distillation: logprobs and weights (T, K), K target tokens per position."""
    weights = inputs.get("weights", torch.ones_like(logprobs))
    if weights.shape != logprobs.shape:
        raise LossInputError(
            f"loss_fn_inputs['weights'] has shape {tuple(weights.shape)}; it must match target_tokens, "
            f"shape {tuple(logprobs.shape)}"
        )
    return -(weights * logprobs).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "importance_sampling")
    advantages = _need(inputs, "advantages", len(logprobs), "importance_sampling")
    return -(torch.exp(logprobs - sampled) * advantages).sum()


def _clip_range(config: dict[str, float]) -> tuple[float, float]:
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if not 0 <= lo <= 1 <= hi:
        raise LossInputError(
            f"clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold (got {lo}, {hi})"
        )
    return lo, hi


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, config: dict[str, float]) -> torch.Tensor:
    """-sum_t min(ratio_t A_t, clip(ratio_t) A_t): the pessimistic PPO bound, summed over tokens."""
    lo, hi = _clip_range(config)
    return -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages).sum()


def ppo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "ppo")
    advantages = _need(inputs, "advantages", len(logprobs), "ppo")
    return _clipped_surrogate(torch.exp(logprobs - sampled), advantages, config)


def cispo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "cispo")
    advantages = _need(inputs, "advantages", len(logprobs), "cispo")
    lo, hi = _clip_range(config)
    ratio = torch.exp(logprobs - sampled).clamp(lo, hi).detach()
    return -(ratio * logprobs * advantages).sum()


def dro(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    if "beta" not in config:
        raise LossInputError(
            "loss 'dro' needs loss_fn_config={'beta': ...}, the weight of its quadratic penalty "
            "(Tinker's docs give no default; they show 0.05)"
        )
    beta = config["beta"]
    if beta < 0:
        raise LossInputError(f"loss 'dro' needs loss_fn_config['beta'] >= 0 (got {beta})")
    sampled = _need(inputs, "logprobs", len(logprobs), "dro")
    advantages = _need(inputs, "advantages", len(logprobs), "dro")
    return -(logprobs * advantages - 0.5 * beta * (logprobs - sampled) ** 2).sum()


def gspo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    sampled = _need(inputs, "logprobs", len(logprobs), "gspo")
    advantages = _need(inputs, "advantages", len(logprobs), "gspo")
    in_ratio = _need(inputs, "sequence_ratio_mask", len(logprobs), "gspo") != 0
    if not bool(in_ratio.any()):
        raise LossInputError(
            "loss_fn_inputs['sequence_ratio_mask'] marks no token; it must mark the sampled "
            "tokens the sequence ratio is taken over"
        )
    seq_log_ratio = (logprobs.detach() - sampled)[in_ratio].mean()
    # value: the sequence ratio at every token; gradient: d logp_t of the token's own log-prob
    ratio = torch.exp(seq_log_ratio + logprobs - logprobs.detach())
    return _clipped_surrogate(ratio, advantages, config)


LOSSES: dict[str, Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}

_WHY_NOT = {
    "stable_reinforce": "Tinker has not published StableReinforce's objective (its docs describe it only as a "
    "REINFORCE variant using information recorded at sampling), so it cannot be reproduced",
    "custom": "server-side custom losses are uploaded code this service does not run",
}


def loss_fn(name: str) -> Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]:
    if name not in LOSSES:
        why = f" ({_WHY_NOT[name]})" if name in _WHY_NOT else ""
        raise LossInputError(
            f"loss_fn {name!r} is not served here{why}; this service provides "
            f"{', '.join(LOSSES)} (use forward_backward_custom for anything else)"
        )
    return LOSSES[name]
