"""A key/value cache with one slot per running sequence, grown as the batch and the contexts grow.

Layout per layer: `keys[l]` and `values[l]` of shape (slots, kv_heads, capacity, head_dim).
Invariant kept by the engine: the running sequences occupy slots 0..B-1 with no holes, so a
decode step reads `keys[l][:B, :, :L]`, a view (no copy), and attends with a length mask. A slot
holds garbage past its sequence's length (right padding from a batched prefill, or an older
occupant); the mask hides it and the next write overwrites it.

Neither dimension is preallocated at its bound. The engine `reserve`s slots as its batch grows
(doubling, up to its max_batch), so a run that decodes 16 sequences holds 16 slots' worth, not
max_batch's (at the Qwen3-0.6B shape with 96 positions, 0.35 GB instead of 2.8 GB for the default
128). Positions grow the same way (`hold`: doubling from `INITIAL_POSITIONS`, up to max_seq_len,
when a prefill or a decode writes past the capacity), so an engine built for 32K-token contexts
whose sequences stay short holds short slots: 128 slots at 32K positions would be 8.6 GB for the
embedded tiny model even for a greedy eval of 30-token answers. Growing copies the live part layer
by layer (the transient is one layer's old and new tensors); the cache never shrinks. Its worst
case, max_batch slots x max_seq_len positions, is what memory_fit.py prices.
"""

from __future__ import annotations

import torch

INITIAL_POSITIONS = 256


class KVCache:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.capacity = min(max_seq_len, INITIAL_POSITIONS)  # positions each slot holds now
        shape = (slots, kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots = slots
        self.max_seq_len = max_seq_len

    def reserve(self, slots: int) -> None:
        """Hold at least `slots` slots; the existing slots keep their contents, new ones are zero."""
        if slots <= self.slots:
            return
        self._grow(slots, self.capacity)
        self.slots = slots

    def hold(self, positions: int) -> None:
        """Hold at least `positions` positions per slot (doubling, at most max_seq_len); contents kept."""
        if positions <= self.capacity:
            return
        if positions > self.max_seq_len:
            raise ValueError(f"{positions} positions do not fit a cache of max_seq_len {self.max_seq_len}")
        capacity = min(self.max_seq_len, max(positions, 2 * self.capacity))
        self._grow(self.slots, capacity)
        self.capacity = capacity

    def _grow(self, slots: int, capacity: int) -> None:
        for caches in (self.keys, self.values):
            for layer, old in enumerate(caches):
                grown = old.new_zeros((slots, old.shape[1], capacity, old.shape[3]))
                grown[: old.shape[0], :, : old.shape[2]] = old
                caches[layer] = grown

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write_prefix(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Copy prefilled rows (R, kv_heads, P, head_dim) into `slots` (row `rows[i]` -> slot `slots[i]`)."""
        width = keys.shape[2]
        self.hold(width)
        self.keys[layer][slots, :, :width] = keys[rows]
        self.values[layer][slots, :, :width] = values[rows]

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (to close holes)."""
        if not src:
            return
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        for cache in self.keys + self.values:
            cache[dst_t, :, :length] = cache[src_t, :, :length]
