"""The forward over rows of prefix trees (service/prefix_tree.py), packed into one sequence.

`tree_inputs(config, rows)` is a context manager yielding the model's keyword arguments for the
call: the rows' nodes one after another as one (1, N) sequence, each node's depth as its position
id. Under SDPA (the CPU default) the call swaps in, for that call only, an attention that works row
by row: a row's first sequence (its spine: nodes 0..spine-1, each the parent of the next) runs SDPA's
causal kernel, so a row that is one datum costs what a plain causal forward does; the nodes after
it (the branches, a few tokens each in a multi-turn batch) attend through a (branch nodes x row)
mask to their ancestors. No (N x N) mask exists and no query meets another row's keys. Other
attention implementations get the dense additive (1, 1, N, N) mask of every row's tree instead.
A sliding window (mistral, the gemmas' local layers) bounds the depth distance in both.

Guaranteed: each node's output is the model's causal forward of the one sequence on its path (its
ancestors, then itself) within float rounding (tests/unit/test_service_prefix_tree.py checks
log-probs and gradients against one datum at a time); other threads running the same module
meanwhile (the scorer of prompt log-probs, a generic sampling engine) get plain SDPA. Not guaranteed: models whose forward ignores
`position_ids` or derives its own mask from them (flash-attention's variable-length path).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from gapless.service.prefix_tree import Row, ancestors

TREE_ATTENTION = "gapless_prefix_trees"
# The call's rows, set around the forward on the thread making it, per row (nodes, spine, branch
# mask (nodes - spine, nodes) or None, depths (nodes,)). The config switch is seen by every thread
# using the model (the service's scorer and a generic sampling engine run the same module, and a
# deepcopy taken meanwhile keeps the switch), so on any thread without rows both functions below
# are plain SDPA's.
_state = threading.local()


def _rows() -> list[tuple[int, int, torch.Tensor | None, torch.Tensor]] | None:
    return getattr(_state, "rows", None)


@contextlib.contextmanager
def tree_inputs(config, rows: list[Row]) -> Iterator[dict]:
    ids = torch.tensor([t for row in rows for t in row.tokens])[None]  # (1, N)
    positions = torch.tensor([d for row in rows for d in row.depths])[None]  # (1, N)
    kwargs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", TREE_ATTENTION):  # TREE_ATTENTION: a deepcopy taken during a call
        yield {**kwargs, "attention_mask": _dense_mask(rows, positions[0], getattr(config, "sliding_window", None))}
        return
    _state.rows = [
        (len(r), r.spine, ancestors(r, r.spine) if len(r) > r.spine else None, torch.tensor(r.depths)) for r in rows
    ]
    config._attn_implementation_internal = TREE_ATTENTION  # the internal field: the setter would re-validate
    try:
        yield {**kwargs, "attention_mask": None}
    finally:
        config._attn_implementation_internal = "sdpa"  # a copy taken during a call is restored too
        _state.rows = None


def _dense_mask(rows: list[Row], depths: torch.Tensor, window: int | None) -> torch.Tensor:
    n = len(depths)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for row in rows:
        allowed[start : start + len(row), start : start + len(row)] = ancestors(row, 0)
        start += len(row)
    if window is not None:
        allowed &= depths[:, None] - depths[None, :] < window
    mask = torch.zeros(n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]  # (1, 1, N, N) additive


def _tree_attention(
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
    """query (1, heads, N, d), key and value (1, kv_heads, N, d) -> (1, N, heads, d)."""
    rows = _rows()
    if rows is None:  # another thread's forward on the same model: plain SDPA
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    repeat = query.shape[1] // key.shape[1]
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    sizes = [n for n, _, _, _ in rows]
    dropout = dropout if module.training else 0.0
    out = []
    # one split per tensor, not a slice per row: a slice's backward writes a full-size zero tensor per row
    for (n, spine, branch_mask, depths), q, k, v in zip(
        rows, query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2)
    ):
        chain_mask = None
        if sliding_window is not None and spine > sliding_window:  # q attends to k when q - window < k <= q
            i = torch.arange(spine)
            chain_mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - sliding_window)
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, :spine],
                k[:, :, :spine],
                v[:, :, :spine],
                attn_mask=chain_mask,
                dropout_p=dropout,
                is_causal=chain_mask is None,
                scale=scaling,
            )
        )
        if branch_mask is not None:
            if sliding_window is not None:
                branch_mask = branch_mask & (depths[spine:, None] - depths[None, :] < sliding_window)
            out.append(
                F.scaled_dot_product_attention(
                    q[:, :, spine:], k, v, attn_mask=branch_mask, dropout_p=dropout, scale=scaling
                )
            )
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_ATTENTION, _tree_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(
    TREE_ATTENTION,
    lambda *args, **kwargs: None if _rows() is not None else ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs),
)  # rows, not a mask, on the thread making the call
