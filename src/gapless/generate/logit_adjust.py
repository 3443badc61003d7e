"""Per-request logit adjustments inside a continuous batch: logit bias and repetition penalties.

    apply_adjustments(logits (B, V), rows) -> logits with each listed row adjusted

Each adjusted row is changed by its own request's `LogitAdjustment` (types.py), computed from
that sequence's own prompt and generated tokens, so a request's tokens do not depend on which
other requests share its batch; rows not listed are returned bit for bit. Order, as vLLM applies
them: repetition penalty (prompt and output tokens), then frequency and presence penalties
(output tokens only, OpenAI's definition), then the bias.
Not guaranteed: any effect on the top alternatives that scoring.py reports (a full forward of
the unadjusted model) -- only the sampled token's log-prob is under the adjusted distribution.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gapless.types import LogitAdjustment


def apply_adjustments(
    logits: torch.Tensor, rows: Sequence[tuple[int, LogitAdjustment, Sequence[int], Sequence[int]]]
) -> torch.Tensor:
    """logits (B, V); rows: (row, adjustment, prompt ids, generated ids). Returns a new tensor
    when any row is adjusted (the engine's logits buffer is left untouched)."""
    if not rows:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i, adj, prompt, generated in rows:
        row = out[i]
        if adj.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(list(prompt) + list(generated), dtype=torch.long)] = True
            penalised = torch.where(row > 0, row / adj.repetition_penalty, row * adj.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if generated and (adj.frequency_penalty or adj.presence_penalty):
            counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab)[:vocab].float()
            row -= adj.frequency_penalty * counts + adj.presence_penalty * (counts > 0).float()
        if adj.logit_bias:
            ids = torch.tensor([t for t, _ in adj.logit_bias], dtype=torch.long)
            row[ids] += torch.tensor([v for _, v in adj.logit_bias], dtype=out.dtype)
    return out
