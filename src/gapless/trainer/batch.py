"""Pack rollouts into the padded tensors one trainer step consumes.

Each row is prompt + completion, right-padded. Position t of every (B, T) tensor refers to
predicting token t + 1 (T = L - 1), so `loss_mask` is 1 exactly on completion tokens; prompt
and padding positions are 0. Behaviour log-probs and per-token policy versions are copied from
the completion records, aligned on the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gapless.types import Completion


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1)
    old_logprobs: torch.Tensor  # (B, L-1)
    advantages: torch.Tensor  # (B,)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(*(t[start:stop] for t in (self.input_ids, self.attention_mask, self.loss_mask, self.old_logprobs, self.advantages)))

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def build_batch(completions: list[Completion], advantages: list[float], valid: list[bool], pad_id: int) -> Batch:
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    n = len(completions)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.float32)
    old_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
    for row, (c, ok) in enumerate(zip(completions, valid)):
        seq = c.prompt_ids + c.token_ids
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
        start, stop = len(c.prompt_ids) - 1, len(seq) - 1
        old_logprobs[row, start:stop] = torch.tensor(c.logprobs, dtype=torch.float32)
        if ok:
            loss_mask[row, start:stop] = 1.0
    return Batch(input_ids, attention_mask, loss_mask, old_logprobs, torch.tensor(advantages, dtype=torch.float32))


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) for every t, shape (B, L-1), at the sampling temperature."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (B, L-1, V)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
