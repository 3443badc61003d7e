"""Log-probs and entropy of chosen tokens from hidden states, the LM head applied a chunk at a time.

`head_logprobs(hidden, weight, bias, targets, T)` = log_softmax((hidden @ weight.T + bias) / T)
[target] and the entropy of each next-token distribution, for M positions, without ever holding the
(M, V) logits: the forward computes logits `chunk` positions at a time and keeps one log-sum-exp
and one entropy per position; the backward recomputes each chunk's logits and turns them straight
into the gradients of the hidden states, the head's weight and its bias. At a 151,936-token
vocabulary that bounds the head's transient to `LOGITS_CHUNK_BYTES` whatever the sequence length
(the full logits of a 32K-token rollout would be 20 GB in float32).

Gradients, with z = logits / T, p = softmax(z), H = -sum p log p, and upstream g (log-prob), h (entropy):
    dlogp_target / dz = onehot(target) - p         dH / dz = -p * (log p + H)
    dL / dlogits = (g * (onehot - p) - h * p * (log p + H)) / T
so the entropy carries gradient too (an entropy bonus) at no extra memory.

Guaranteed: values and gradients equal the log-softmax over materialised logits within the
rounding of the compute dtype (float32 at least; float64 stays float64), tested against it.
Not provided: logit soft-capping or any head that is not one linear layer (batch.py falls back
to the materialised path for those).
"""

from __future__ import annotations

import torch

LOGITS_CHUNK_BYTES = 128 << 20  # one chunk's logits and their softmax, in the compute dtype


def chunk_positions(vocab_size: int) -> int:
    """Positions per chunk so that a chunk's float32 logits and one same-sized transient fit
    `LOGITS_CHUNK_BYTES`."""
    return max(16, LOGITS_CHUNK_BYTES // (2 * 4 * vocab_size))


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int):
        dtype = _compute_dtype(hidden)
        picked = hidden.new_empty(hidden.shape[0], dtype=dtype)
        lse, entropy = torch.empty_like(picked), torch.empty_like(picked)
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            z = _scaled_logits(hidden[lo:hi], weight, bias, temperature, dtype)  # (C, V)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            picked[lo:hi] = z.gather(-1, targets[lo:hi, None]).squeeze(-1) - lse[lo:hi]
            entropy[lo:hi] = lse[lo:hi] - (torch.softmax(z, dim=-1) * z).sum(-1)  # softmax: p sums to 1 exactly
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)  # an unused entropy's gradient arrives as None, not as zeros to multiply
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=ctx.dtype) if needs_weight else None
        grad_bias = torch.zeros_like(bias, dtype=ctx.dtype) if needs_bias else None
        w = weight.to(ctx.dtype)
        for lo in range(0, hidden.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, hidden.shape[0])
            logp = _scaled_logits(hidden[lo:hi], weight, bias, ctx.temperature, ctx.dtype) - lse[lo:hi, None]  # (C, V)
            p = logp.exp()
            grad = torch.zeros_like(p)  # (C, V): dL/dz
            if grad_picked is not None:
                g = grad_picked[lo:hi, None].to(ctx.dtype)
                grad = p * -g
                grad.scatter_add_(-1, targets[lo:hi, None], g)
            if grad_entropy is not None:
                grad -= p * (logp + entropy[lo:hi, None]) * grad_entropy[lo:hi, None].to(ctx.dtype)
            if ctx.temperature != 1.0:
                grad /= ctx.temperature
            if needs_hidden:
                grad_hidden[lo:hi] = (grad @ w).to(hidden.dtype)
            if needs_weight:
                grad_weight += grad.T @ hidden[lo:hi].to(ctx.dtype)
            if needs_bias:
                grad_bias += grad.sum(0)
        return grad_hidden, _cast(grad_weight, weight), _cast(grad_bias, bias), None, None, None


def _cast(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)


def _scaled_logits(hidden, weight, bias, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """(C, V) logits / T in `dtype`: a bfloat16 head computes in bfloat16, as the model's own head
    would, and is promoted after (`head_logprobs(fp32=True)` hands it float32 inputs instead)."""
    z = torch.nn.functional.linear(hidden, weight, bias).to(dtype)
    return z if temperature == 1.0 else z / temperature


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
    fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (M, H), weight (V, H), bias (V,) or None, targets (M,) -> (log p(target), entropy),
    each (M,) in float32 or wider. `fp32`: compute the head in float32 whatever the weights' dtype."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"head_logprobs: hidden {tuple(hidden.shape)} does not match targets {tuple(targets.shape)}")
    if fp32:
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
    chunk = chunk or chunk_positions(weight.shape[0])
    return _ChunkedHead.apply(hidden, weight, bias, targets, float(temperature), chunk)
