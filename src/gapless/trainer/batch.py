"""Pack rollouts into the padded tensors one trainer step consumes.

Each row is prompt + completion, right-padded. Position t of every (B, T) tensor refers to
predicting token t + 1 (T = L - 1), so `loss_mask` is 1 exactly on the completion tokens of rows
that train; prompt and padding positions are 0. The generator's behaviour log-probs are copied
from the completion records onto the same positions. A multi-turn completion's own `loss_mask`
(0 on tokens the environment wrote, e.g. tool output) is copied there too, so those tokens are
context for the model but contribute nothing to any loss, normaliser or metric. `group_ids` say which rows are one prompt's
group: the per-group normalisers and the zero-variance filter need them. A batch is always the
whole step; micro-batches are subsets of its rows, never of its groups' statistics.

`micro_batches` orders the rows by length, cuts the step into as many micro-batches as
`micro_batch_size` rows each would need, and places the cuts so that the largest micro-batch
(rows x its own longest row, padding included) is as small as possible: a forward pass over
right padding is work thrown away, and the largest micro-batch sets the step's activation memory.
So no micro-batch holds more padded tokens than `micro_batch_size` x the step's longest row,
though a micro-batch of short rows may hold more rows than that. Which rows share a micro-batch
changes only the order of float sums.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from gapless.trainer.micro_batches import micro_batch_rows, token_budget_rows
from gapless.trainer.selected_logprobs import selected_logprobs
from gapless.types import Completion


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1) 1 on completion tokens that train
    behaviour_logprobs: torch.Tensor  # (B, L-1) generator's sampling log-probs
    advantages: torch.Tensor  # (B,)
    group_ids: torch.Tensor  # (B,) long

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, size: int) -> list[tuple[torch.Tensor, "Batch"]]:
        """(row index, micro-batch) pairs covering every row once, in ceil(rows / size) micro-batches
        of length-sorted rows, each cut to its own longest row (see the module docstring)."""
        out = []
        for rows, width in micro_batch_rows(self.attention_mask.sum(-1).tolist(), size):
            out.append((torch.tensor(rows, dtype=torch.long), self.select(rows).cut_to(width)))
        return out

    def packed_micro_batches(self, max_tokens: int) -> list[tuple[torch.Tensor, "Batch"]]:
        """(row index, micro-batch) pairs covering every row once, each micro-batch at most
        `max_tokens` real tokens (a longer row alone), cut to its own longest row; the forward
        packs its rows (packing.py), so the padding left here is only the loss's layout."""
        out = []
        for rows in token_budget_rows(self.attention_mask.sum(-1).tolist(), max_tokens):
            mb = self.select(rows)
            out.append((torch.tensor(rows, dtype=torch.long), mb.cut_to(max(int(mb.attention_mask.sum(-1).max()), 2))))
        return out

    def cut(self, micro_batch_size: int, max_tokens: int = 0) -> list[tuple[torch.Tensor, "Batch"]]:
        """The trainer's micro-batches: packed under a token budget when `max_tokens` > 0, else
        `micro_batches(micro_batch_size)`."""
        return self.packed_micro_batches(max_tokens) if max_tokens > 0 else self.micro_batches(micro_batch_size)

    def cut_to(self, width: int) -> "Batch":
        """The first `width` token positions of every row (`width` - 1 predicted positions)."""
        return replace(
            self,
            input_ids=self.input_ids[:, :width],
            attention_mask=self.attention_mask[:, :width],
            loss_mask=self.loss_mask[:, : width - 1],
            behaviour_logprobs=self.behaviour_logprobs[:, : width - 1],
        )

    def select(self, index: list[int]) -> "Batch":
        keep = torch.tensor(index, dtype=torch.long)
        return Batch(*(getattr(self, f.name).index_select(0, keep) for f in fields(self)))

    def with_targets(self, advantages: list[float], is_trainable: list[bool]) -> "Batch":
        """Set advantages and drop the loss of rows that must not train (mask, not removal)."""
        trainable = torch.tensor(is_trainable, dtype=self.loss_mask.dtype)[:, None]  # (B, 1)
        return replace(
            self, advantages=torch.tensor(advantages, dtype=torch.float32), loss_mask=self.loss_mask * trainable
        )

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def build_batch(
    completions: list[Completion],
    advantages: list[float],
    valid: list[bool],
    pad_id: int,
    group_ids: list[int] | None = None,
) -> Batch:
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    n = len(completions)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.float32)
    behaviour_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
    for row, (c, ok) in enumerate(zip(completions, valid)):
        seq = c.prompt_ids + c.token_ids
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
        start, stop = len(c.prompt_ids) - 1, len(seq) - 1
        behaviour_logprobs[row, start:stop] = torch.tensor(c.logprobs, dtype=torch.float32)
        if ok:
            own = torch.ones(stop - start) if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.float32)
            loss_mask[row, start:stop] = own
    groups = torch.tensor(group_ids if group_ids is not None else [0] * n, dtype=torch.long)
    return Batch(
        input_ids, attention_mask, loss_mask, behaviour_logprobs, torch.tensor(advantages, dtype=torch.float32), groups
    )


def first_trained_position(loss_mask: torch.Tensor) -> int:
    """The first position any row trains on (0 when none does): the log-probs before it are not
    needed, so the LM head and the log-softmax can skip the prompts."""
    trained = loss_mask.any(0).nonzero()
    return int(trained[0]) if len(trained) else 0


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int) -> torch.Tensor:
    """(B, L-1-first, V): the logits at positions first..L-2. The model computes the LM head only
    there when its forward takes `logits_to_keep` (Hugging Face causal LMs); else all, sliced."""
    keep = input_ids.shape[1] - first
    kwargs = {"logits_to_keep": keep} if first > 0 and _takes_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    return logits[:, -keep:-1]  # (B, L-1-first, V) whether or not the model honoured logits_to_keep


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    while True:  # through the wrappers that pass keyword arguments on: DDP (.module), peft (.get_base_model())
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    first: int = 0,
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) for every t >= `first` at the sampling temperature, shape
    (B, L-1), 0 before `first` (pass `first_trained_position(loss_mask)` to skip the prompts)."""
    logp, _ = selected_logprobs(
        _logits(model, input_ids, attention_mask, first), input_ids[:, first + 1 :], temperature
    )
    return F.pad(logp, (first, 0))


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` plus the entropy of each next-token distribution, both (B, L-1), 0 before
    `first`. The entropy carries gradient only with `entropy_grad` (an entropy bonus: the plain
    log-softmax path); otherwise it is a metric (selected_logprobs.py, which keeps no (B, T, V)
    log-softmax)."""
    logits, targets = _logits(model, input_ids, attention_mask, first), input_ids[:, first + 1 :]
    if entropy_grad and torch.is_grad_enabled():
        logp = torch.log_softmax(
            logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1
        )  # (B, T, V)
        entropy = -(logp.exp() * logp).sum(-1)
        picked = logp.gather(-1, targets[..., None]).squeeze(-1)
    else:
        picked, entropy = selected_logprobs(logits, targets, temperature, with_entropy=True)
    return F.pad(picked, (first, 0)), F.pad(entropy, (first, 0))
