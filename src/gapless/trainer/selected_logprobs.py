"""Log-probs of the chosen tokens from (B, T, V) logits without a (B, T, V) log-softmax.

`selected_logprobs(logits, targets, T)` = log_softmax(logits / T)[..., target] and, as a metric
without gradient, the entropy of each next-token distribution. At a real vocabulary the logits
are the step's largest tensors (16 rows x 96 positions x 151,936 tokens is 0.93 GB in float32),
and the plain formulation keeps several of them: the scaled logits, the log-softmax saved for
backward, its exp for the entropy, and in backward the scattered gradient and the log-softmax's
own. Here the forward works one row at a time (transients of one (T, V) row), saves only the
logits (alive anyway) and one log-sum-exp per position, and backward writes the logits' gradient
(softmax * -g, plus g at the target) into one new tensor, again a row at a time.

Guaranteed: the values equal the log-softmax formulation within float32 rounding (tested against
it, gradient included, at temperatures 1 and != 1). Not provided: a gradient through the entropy;
an entropy bonus uses batch.token_logprobs_and_entropy's plain path.
"""

from __future__ import annotations

import torch


class _SelectedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        rows = logits.shape[0]
        picked = torch.empty(logits.shape[:-1], dtype=_dtype(logits), device=logits.device)
        lse = torch.empty_like(picked)
        entropy = torch.empty_like(picked) if with_entropy else None
        for b in range(rows):
            z = _scaled(logits[b], temperature)  # (T, V)
            lse[b] = torch.logsumexp(z, dim=-1)
            picked[b] = z.gather(-1, targets[b, :, None]).squeeze(-1) - lse[b]
            if entropy is not None:  # H = lse - sum p z; softmax, not exp(z - lse): p must sum to 1 exactly here
                # (the cancellation in lse - sum p z turned exp(z - lse)'s rounding into 2e-5 of error)
                entropy[b] = lse[b] - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        if entropy is None:
            return picked, picked.new_zeros(())
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for b in range(logits.shape[0]):
            g = grad_picked[b].to(_dtype(logits))[:, None]  # (T, 1)
            row = torch.exp(_scaled(logits[b], ctx.temperature) - lse[b, :, None]).mul_(-g)  # -softmax * g
            row.scatter_add_(-1, targets[b, :, None], g)
            if ctx.temperature != 1.0:
                row.div_(ctx.temperature)
            grad[b] = row
        return grad, None, None, None


def _dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)  # float32 at least; float64 stays float64


def _scaled(row: torch.Tensor, temperature: float) -> torch.Tensor:
    row = row.to(_dtype(row))
    return row if temperature == 1.0 else row / temperature


def selected_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits (B, T, V), targets (B, T) -> (log p(target), entropy or None), each (B, T) float32 (float64 for float64 logits)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"selected_logprobs: logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    picked, entropy = _SelectedLogProbs.apply(logits, targets, float(temperature), with_entropy)
    return picked, (entropy if with_entropy else None)
