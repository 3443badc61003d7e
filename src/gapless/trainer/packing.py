"""The packed forward: a micro-batch's rows run as one sequence, each row attending only to itself.

`packed_logprobs_and_entropy(model, input_ids, attention_mask, need, T)` concatenates the rows'
real tokens (right padding dropped) into one (1, N) sequence with position ids restarted at 0 for
every row, runs the model once, and returns each row's next-token log-probs and entropies in the
batch's padded (B, L-1) layout, 0 where `need` is false. The LM head runs only at the needed
positions and a chunk at a time (chunked_head.py), so neither the padding nor the (tokens x vocab)
logits are ever computed in full.

Sequence boundaries: under SDPA (the CPU default) the packed call swaps in, for that call only,
an attention that runs SDPA's causal kernel on each row's own span (`_segment_attention`): the
cost is the rows' own sum of length^2 and no (N x N) mask exists; a sliding window (mistral, the
gemmas' local layers) becomes a banded mask within the row. Under flash-attention transformers
derives the rows' boundaries from the restarted position ids (its variable-length kernel); under
eager attention it builds the block-diagonal (N x N) mask itself. A micro-batch of one row is the
plain causal forward either way.

Guaranteed: the log-probs equal the padded forward's at every needed position within float
rounding (tested on the tiny model, forward and gradient). Not guaranteed: models whose forward
ignores `position_ids` or builds its own mask from them differently; a head that is not one
linear layer, or logit soft-capping, takes the materialised path (every kept position's logits).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from gapless.trainer.chunked_head import head_logprobs

SEGMENT_ATTENTION = "gapless_segments"
_spans: list[tuple[int, int]] = []  # the packed call's rows as [start, stop), set around the forward


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows (B, L) -> packed ids (1, N), position ids (1, N), each row's offset (B,)."""
    lengths = attention_mask.sum(-1)  # (B,)
    offsets = torch.cumsum(lengths, 0) - lengths
    keep = attention_mask.bool()
    ids = input_ids[keep][None]  # (1, N) row after row: boolean indexing keeps row-major order
    positions = (torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids))[keep][None]
    return ids, positions, offsets


def packed_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    need: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(input_ids[b, t+1] | row b's prefix) and the entropy there, each (B, L-1), at the
    positions where `need` (B, L-1) is true (0 elsewhere); both carry gradient."""
    lengths = attention_mask.sum(-1)
    need = need.bool() & (torch.arange(need.shape[1], device=need.device)[None] < (lengths - 1)[:, None])
    ids, positions, offsets = pack(input_ids, attention_mask)
    rows, cols = need.nonzero(as_tuple=True)  # (M,) each
    flat = offsets[rows] + cols  # (M,) packed positions whose next token is scored
    targets = ids[0, flat + 1]
    stops = torch.cumsum(lengths, 0).tolist()
    with _segments(_unwrap(model).config, list(zip([0, *stops[:-1]], stops))):
        picked, entropy = _head_at(model, ids, positions, flat, targets, temperature)
    shape = need.shape
    return (
        picked.new_zeros(shape).index_put((rows, cols), picked),
        entropy.new_zeros(shape).index_put((rows, cols), entropy),
    )


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


@contextlib.contextmanager
def _segments(config, spans: list[tuple[int, int]]):
    """Under SDPA, attend within `spans` only (the module docstring) for the duration of the call."""
    if getattr(config, "_attn_implementation", None) != "sdpa" or len(spans) < 2:
        yield
        return
    _spans[:] = spans
    config._attn_implementation_internal = SEGMENT_ATTENTION  # the internal field: the setter would re-validate
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"
        _spans.clear()


def _segment_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, heads, N, d), key and value (1, kv_heads, N, d) -> (1, N, heads, d): causal
    SDPA over each span of `_spans` alone."""
    repeat = query.shape[1] // key.shape[1]
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    sizes = [hi - lo for lo, hi in _spans]
    out = []
    # one split per tensor, not a slice per row: a slice's backward writes a full-size zero tensor per row
    for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2)):
        mask = None
        if sliding_window is not None and q.shape[2] > sliding_window:  # q attends to k when q - window < k <= q
            i = torch.arange(q.shape[2], device=query.device)
            mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - sliding_window)
        out.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout if module.training else 0.0,
                is_causal=mask is None,
                scale=scaling,
            )
        )
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register(SEGMENT_ATTENTION, _segment_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENT_ATTENTION, lambda *args, **kwargs: None)  # spans, not a mask


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
