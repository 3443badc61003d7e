"""The packed forward: a micro-batch's rows run as one sequence, each row attending only to itself.

`packed_logprobs_and_entropy(model, input_ids, attention_mask, need, T)` concatenates the rows'
real tokens (right padding dropped) into one (1, N) sequence with position ids restarted at 0 for
every row, runs the model once, and returns each row's next-token log-probs and entropies in the
batch's padded (B, L-1) layout, 0 where `need` is false. The LM head runs only at the needed
positions and a chunk at a time (chunked_head.py), so neither the padding nor the (tokens x vocab)
logits are ever computed in full.

Sequence boundaries: with no 2-D attention mask and restarted position ids, transformers detects
the packing from the position ids (`masking_utils.find_packed_sequence_indices`) and builds a
block-diagonal causal mask for SDPA and eager attention, or passes the boundaries to flash-attention's
variable-length kernel; a micro-batch of one row keeps the plain causal path. The mask it builds
for SDPA is (N x N) booleans, which the token budget of a micro-batch bounds.

Guaranteed: the log-probs equal the padded forward's at every needed position within float
rounding (tested on the tiny model, forward and gradient). Not guaranteed: models whose forward
ignores `position_ids` or builds its own mask from them differently; a head that is not one
linear layer, or logit soft-capping, takes the materialised path (every kept position's logits).
"""

from __future__ import annotations

import inspect

import torch

from gapless.trainer.chunked_head import head_logprobs


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows (B, L) -> packed ids (1, N), position ids (1, N), each row's offset (B,)."""
    lengths = attention_mask.sum(-1)  # (B,)
    offsets = torch.cumsum(lengths, 0) - lengths
    keep = attention_mask.bool()
    ids = input_ids[keep][None]  # (1, N) row after row: boolean indexing keeps row-major order
    positions = (torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids))[keep][None]
    return ids, positions, offsets


def packed_logprobs_and_entropy(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                need: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(input_ids[b, t+1] | row b's prefix) and the entropy there, each (B, L-1), at the
    positions where `need` (B, L-1) is true (0 elsewhere); both carry gradient."""
    lengths = attention_mask.sum(-1)
    need = need.bool() & (torch.arange(need.shape[1], device=need.device)[None] < (lengths - 1)[:, None])
    ids, positions, offsets = pack(input_ids, attention_mask)
    rows, cols = need.nonzero(as_tuple=True)  # (M,) each
    flat = offsets[rows] + cols  # (M,) packed positions whose next token is scored
    targets = ids[0, flat + 1]
    picked, entropy = _head_at(model, ids, positions, flat, targets, temperature)
    shape = need.shape
    return (picked.new_zeros(shape).index_put((rows, cols), picked),
            entropy.new_zeros(shape).index_put((rows, cols), entropy))


def _head_at(model, ids, positions, flat, targets, temperature):
    """(log p(target), entropy) at packed positions `flat`, (M,) each. The model's own forward runs
    (so data-parallel and peft wrappers see the call) with its LM head swapped, for this call, for
    the chunked one over the hidden states the model hands it."""
    inner = _unwrap(model)
    head = inner.get_output_embeddings()
    kwargs = {"input_ids": ids, "position_ids": positions, "attention_mask": None, "use_cache": False}
    if not _is_plain_head(inner, head):
        logits = model(**kwargs).logits[0, flat].float() / temperature  # (M, V) materialised
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    fp32 = type(head).__name__ == "FP32Head"

    def chunked(hidden: torch.Tensor) -> torch.Tensor:  # hidden (1, M, H): the model keeps only `flat`
        out.append(head_logprobs(hidden[0], head.weight, head.bias, targets, temperature, fp32=fp32))
        return hidden[..., :0]  # (1, M, 0): the model's logits, unused

    head.forward = chunked  # an instance attribute shadows the class's forward for this call only
    try:
        model(**kwargs, logits_to_keep=flat)
    finally:
        del head.forward
    return out[0]


def _is_plain_head(model: torch.nn.Module, head) -> bool:
    if not isinstance(head, torch.nn.Linear) or getattr(model.config, "final_logit_softcapping", None):
        return False
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while True:  # through the wrappers that pass keyword arguments on: DDP (.module), peft (.get_base_model())
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model
