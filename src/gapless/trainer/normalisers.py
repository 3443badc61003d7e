"""How per-token losses are averaged into one step loss, with counts fixed for the whole step.

Every aggregation is written as per-token weights: step loss = sum over tokens of
weight * per-token loss, the weight being 0 on masked tokens. The counts a weight divides by
(tokens, sequences, groups, rows of the step, sequences per group) are taken once over the whole
step's batch, before its first micro-batch, and only selected by row afterwards; a row's own token
count lives in its row. So the micro-batch losses of a step sum exactly to the one-batch loss,
and their gradients to its gradient, whichever aggregation is chosen.

    token_mean        1 / (loss tokens in the step)                       DAPO, CISPO
    seq_group_mean    1 / (|o_i| * sequences in i's group * groups)        GRPO paper
    seq_mean          1 / (|o_i| * sequences in the step)                  GSPO
    constant          1 / (rows in the step * max_new_tokens)              Dr. GRPO
A sequence counts when it has at least one loss token (infrastructure failures and masked
truncations do not); a group counts when one of its sequences does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class StepNorm:
    num_tokens: int
    num_sequences: int
    num_groups: int
    num_rows: int
    max_new_tokens: int
    group_sizes: torch.Tensor  # (B,) sequences with a loss token in each row's group, whole step

    @classmethod
    def of(cls, loss_mask: torch.Tensor, group_ids: torch.Tensor, max_new_tokens: int) -> "StepNorm":
        has_loss = (loss_mask.sum(-1) > 0).to(torch.float32)  # (B,)
        _, group_index = torch.unique(group_ids, return_inverse=True)  # (B,) in 0..G-1
        per_group = torch.zeros(int(group_index.max()) + 1 if len(group_ids) else 0).index_add_(
            0, group_index, has_loss
        )  # (G,)
        return cls(
            num_tokens=int(loss_mask.sum()),
            num_sequences=int(has_loss.sum()),
            num_groups=int((per_group > 0).sum()),
            num_rows=loss_mask.shape[0],
            max_new_tokens=max_new_tokens,
            group_sizes=per_group[group_index],
        )

    def select(self, index: torch.Tensor | slice) -> "StepNorm":
        """The same step counts for a micro-batch of these rows."""
        return replace(self, group_sizes=self.group_sizes[index])


def token_mean(mask: torch.Tensor, norm: StepNorm) -> torch.Tensor:
    return mask / max(norm.num_tokens, 1)


def seq_group_mean(mask: torch.Tensor, norm: StepNorm) -> torch.Tensor:
    row_tokens = mask.sum(-1).clamp(min=1)  # (B,)
    return mask / (row_tokens * norm.group_sizes.clamp(min=1) * max(norm.num_groups, 1))[:, None]


def seq_mean(mask: torch.Tensor, norm: StepNorm) -> torch.Tensor:
    row_tokens = mask.sum(-1).clamp(min=1)  # (B,)
    return mask / (row_tokens * max(norm.num_sequences, 1))[:, None]


def constant(mask: torch.Tensor, norm: StepNorm) -> torch.Tensor:
    return mask / (norm.num_rows * norm.max_new_tokens)
