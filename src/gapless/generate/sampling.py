"""Batched token sampling with per-row settings and caller-supplied random numbers.

Each row has its own temperature, top-p, top-k and greedy flag, and one uniform number u in
[0, 1). A sampled row takes the first token whose cumulative (truncated) probability, in
vocabulary order, exceeds u times the kept mass: inverse-CDF sampling. Because the random
number comes from the sequence's own stream (see `uniform_stream`) and not from a generator
shared by the batch, a sequence's tokens do not depend on which other sequences share its
batch, nor on the slot it occupies.

The returned log-prob is that of the token under the distribution actually sampled from:
log_softmax(logits / T) minus log(kept mass) when top-p/top-k truncate, so with no truncation
it equals the trainer's `token_logprobs` at temperature T. Greedy rows return
log_softmax(logits) of the argmax (temperature is ignored for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def uniform_stream(seed: int, length: int) -> torch.Tensor:
    """The random numbers of one sequence: element t draws its t-th generated token."""
    return torch.rand(length, generator=torch.Generator().manual_seed(seed))


def sample_seed(request_seed: int, index: int) -> int:
    """Seed of the stream of sample `index` of a request (a fixed 63-bit mix, not Python's hash)."""
    return (request_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


@dataclass
class RowSettings:
    """Per-row sampling settings of a batch, as tensors (B,)."""

    temperature: torch.Tensor  # float, 1.0 on greedy rows
    top_p: torch.Tensor  # float, 1.0 = off
    top_k: torch.Tensor  # int64, 0 = off
    greedy: torch.Tensor  # bool
    any_truncation: bool
    any_greedy: bool
    all_greedy: bool


def sample_rows(
    logits: torch.Tensor, rows: RowSettings, u: torch.Tensor, native=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V), u (B,) -> tokens (B,) and their sampling log-probs (B,). `native`: the
    engine's native kernels, which take the batches with no greedy and no truncated row."""
    if native is not None and not rows.any_greedy and not rows.any_truncation:
        return native.sample_rows(logits, rows.temperature, u)
    logits = logits.float()
    if rows.all_greedy:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        token = logits.argmax(dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    probs = torch.softmax(logits / rows.temperature[:, None], dim=-1)  # (B, V)
    kept_mass = None
    if rows.any_truncation:
        probs, kept_mass = _truncate(probs, rows.top_p, rows.top_k)
    cdf = probs.cumsum(dim=-1)  # (B, V)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # < total: lands on a kept token
    token = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    if rows.any_greedy:
        token = torch.where(rows.greedy, logits.argmax(dim=-1), token)
    # log of the softmax entry, not log_softmax over the row: one (B,) log instead of a (B, V) pass;
    # it differs from log_softmax by float rounding (~1e-7), far inside the 1e-5 contract
    token_logp = probs.gather(-1, token[:, None]).squeeze(-1).log()
    if kept_mass is not None:
        token_logp = token_logp - kept_mass.log()
    return token, token_logp


def _truncate(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the tokens outside each row's top-k and top-p nucleus; return them and the kept mass
    (exactly 1 on rows without truncation, so their log-probs are untouched)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None]
    outside = (sorted_probs.cumsum(-1) - sorted_probs) > top_p[:, None]  # the top token always stays
    outside |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    keep = torch.ones_like(outside).scatter_(-1, order, ~outside)
    truncated = (top_p < 1.0) | (top_k > 0)
    kept = probs * keep
    kept_mass = torch.where(truncated, kept.sum(-1), torch.ones_like(top_p))
    return torch.where(truncated[:, None], kept, probs), kept_mass
