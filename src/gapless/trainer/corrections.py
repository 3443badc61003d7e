"""Off-policy corrections between the generator's behaviour log-probs and the trainer's.

The generator samples from p_behaviour; the trainer's policy at the start of the step is
p_trainer. They differ when rollouts are stale (async) or when the engine's numerics differ from
the trainer's (bf16 kernels, another attention implementation). The importance weight
    rho_t = p_trainer(y_t) / p_behaviour(y_t)                       (token level)
    rho   = prod_t rho_t over the sequence's loss tokens            (sequence level, all its tokens)
multiplies the policy term of the loss, without gradient. Two ways to bound its variance:
    tis   truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
          off-policy RL training"):  w = min(rho, C)
    mis   masked IS (Liu et al. 2025, "When speed kills stability"): w = rho if low <= rho <= high,
          else 0 -- the token (or the whole sequence) leaves the policy term; the step's
          normaliser is unchanged, so masking never rescales the rest.
Weights are computed in log space, so a long sequence's product never overflows.
Diagnostics (`offpolicy/*`, always reported): mean and max rho, fraction truncated or masked
(over tokens, or over sequences at sequence level), and the behaviour-vs-trainer KL estimated
with k3 on the behaviour samples: mean over tokens of rho_t - 1 - log rho_t.
With zero staleness and matching numerics rho = 1 up to float tolerance, and the corrections
change nothing (tested on the project's own sampler and trainer).
"""

from __future__ import annotations

import math

import torch

_LOG_CLAMP = 20.0  # metrics only: keeps exp() of a sequence's log-ratio finite


def importance_weights(
    trainer_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Correction weights (B, T), no gradient, and summable diagnostics for this micro-batch."""
    with torch.no_grad():
        mask = mask.to(trainer_logprobs.dtype)
        token_log_rho = (trainer_logprobs - behaviour_logprobs) * mask  # (B, T)
        log_rho, unit_mask = token_log_rho, mask
        if level == "sequence":
            log_rho = token_log_rho.sum(-1, keepdim=True).expand_as(mask)  # (B, T)
            unit_mask = torch.zeros_like(mask)
            unit_mask[:, 0] = (mask.sum(-1) > 0).to(mask.dtype)  # one unit per sequence with loss
        elif level != "token":
            raise ValueError(f"unknown correction level {level!r}; use 'token' or 'sequence'")
        if kind == "tis":
            weights = torch.exp(log_rho.clamp(max=math.log(cap)))
            cut = log_rho > math.log(cap)
        elif kind == "mis":
            cut = (log_rho < math.log(low)) | (log_rho > math.log(high))
            weights = torch.exp(log_rho.clamp(math.log(low), math.log(high))) * ~cut
        elif kind == "none":
            weights, cut = torch.ones_like(log_rho), torch.zeros_like(mask, dtype=torch.bool)
        else:
            raise ValueError(f"unknown correction {kind!r}; use 'none', 'tis' or 'mis'")
        return weights, _diagnostics(token_log_rho, log_rho, unit_mask, mask, cut)


def _diagnostics(token_log_rho, log_rho, unit_mask, mask, cut) -> dict[str, float]:
    rho = torch.exp(log_rho.clamp(-_LOG_CLAMP, _LOG_CLAMP))  # (B, T)
    k3 = torch.expm1(token_log_rho) - token_log_rho  # rho - 1 - log rho, without cancellation near rho = 1
    units = unit_mask > 0
    return {
        "units": float(units.sum()),
        "rho_sum": float(rho[units].sum()),
        "rho_max": float(rho[units].max()) if bool(units.any()) else 0.0,
        "cut": float((cut & units).sum()),
        "tokens": float(mask.sum()),
        "kl_sum": float((k3 * mask).sum()),
    }


def summarise(parts: list[dict[str, float]], kind: str) -> dict[str, float]:
    """Merge micro-batch diagnostics into `offpolicy/*` metrics for the step."""
    if not parts:
        return {}
    units = max(sum(p["units"] for p in parts), 1.0)
    cut = sum(p["cut"] for p in parts) / units
    metrics = {
        "offpolicy/ratio_mean": sum(p["rho_sum"] for p in parts) / units,
        "offpolicy/ratio_max": max(p["rho_max"] for p in parts),
        "offpolicy/behaviour_kl": sum(p["kl_sum"] for p in parts) / max(sum(p["tokens"] for p in parts), 1.0),
    }
    if kind == "tis":
        metrics["offpolicy/clipped_frac"] = cut
    elif kind == "mis":
        metrics["offpolicy/masked_frac"] = cut
    return metrics
