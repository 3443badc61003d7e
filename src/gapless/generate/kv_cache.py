"""A preallocated key/value cache with one slot per running sequence.

Layout per layer: `keys[l]` and `values[l]` of shape (slots, kv_heads, max_seq_len, head_dim).
Invariant kept by the engine: the running sequences occupy slots 0..B-1 with no holes, so a
decode step reads `keys[l][:B, :, :L]`, a view (no copy), and attends with a length mask. A slot
holds garbage past its sequence's length (right padding from a batched prefill, or an older
occupant); the mask hides it and the next write overwrites it.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (slots, kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots = slots
        self.max_seq_len = max_seq_len

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write_prefix(self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy prefilled rows (R, kv_heads, P, head_dim) into `slots` (row `rows[i]` -> slot `slots[i]`)."""
        width = keys.shape[2]
        self.keys[layer][slots, :, :width] = keys[rows]
        self.values[layer][slots, :, :width] = values[rows]

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (to close holes)."""
        if not src:
            return
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        for cache in self.keys + self.values:
            cache[dst_t, :, :length] = cache[src_t, :, :length]
