"""Per-sequence token constraints: the engine's seam for grammar-constrained decoding.

A `TokenConstraint` is the state of one sequence's grammar (serve/grammar.py builds them from a
JSON schema, a regex, a choice or a tool-call grammar). Each decode step the engine asks every
constrained running sequence for its allowed next tokens as a packed bitmask (bit t of word t // 32
set = token t allowed, the layout xgrammar and llguidance share), sets the other tokens' logits to
-inf on that sequence's row only, samples as usual and hands the sampled token back (`accept`).

Guaranteed: an unconstrained row's logits are untouched (its tokens and log-probs are what they
would be without constrained neighbours); a constrained row samples only allowed tokens, and its
recorded log-prob is under the masked distribution it was sampled from. A constraint that reports
`is_terminated` (its structure is complete and a stop token was accepted) ends the sequence with
finish reason 'stop'. Not guaranteed: that a structure completes within `max_new_tokens` (the
sequence then ends with 'length', its text cut mid-structure).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class TokenConstraint(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (rows, ceil(V / 32)) int32."""
        ...

    def accept(self, token: int) -> None:
        """Advance past `token` (one the last bitmask allowed)."""
        ...

    @property
    def is_terminated(self) -> bool:
        """The structure is complete and a stop token was accepted: the sequence is over."""
        ...


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear. logits (B, V),
    bitmask (len(rows), ceil(V / 32)) int32."""
    index = torch.tensor(rows, dtype=torch.long)
    vocab = logits.shape[-1]
    bits = (bitmask[:, :, None] >> _SHIFTS) & 1  # (R, W, 32): bit j of word w is token 32 w + j
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()  # (R, V)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
