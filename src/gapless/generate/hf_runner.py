"""The engine's generic path: any HF causal LM's own module under the engine's continuous batching.

`HFRunner` has the runner surface the engine drives (`prefill`, `place`, `stash_row`, `decode`,
`load_state`, `state_dict`), over a private copy of the model. Each slot holds that sequence's
own HF cache (whatever class the model builds: sliding-window and hybrid layers included), so a
prefill runs one row at a time and a decode step runs one HF forward per running sequence.

Guaranteed: the logits are the HF module's own (soft-capping, embedding scales, alternating
local/global attention, norm variants all come from the model's code), so greedy decoding equals
`generate` and the sampled log-probs equal the trainer's. Everything the engine adds on top --
slots, groups sharing one prefill, aborts, resumes, in-flight weight swaps, policy versions -- is
the same code as on the lean path.
Not guaranteed: speed. Decoding costs B small forwards per step instead of one batched one;
this path exists so that every checkpoint trains, and the lean runner (`runner.py`) is where a
family goes once it matters.
"""

from __future__ import annotations

import copy

import torch

from gapless.generate.native import kernels_for


class SlotCaches:
    """One HF cache object per slot (None until a sequence's prefix is placed there)."""

    def __init__(self, slots: int):
        self.rows: list[object | None] = [None] * slots
        self.slots = slots

    @property
    def num_bytes(self) -> int:
        """Bytes the slots' caches hold now (they grow with their sequences; nothing is preallocated)."""
        total = 0
        for cache in filter(None, self.rows):
            for layer in getattr(cache, "layers", []):
                total += sum(
                    t.numel() * t.element_size()
                    for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor)
                )
        return total

    def reserve(self, slots: int) -> None:
        self.rows += [None] * (slots - self.slots)
        self.slots = max(self.slots, slots)

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        for s, d in zip(src, dst):
            self.rows[d] = self.rows[s]


class HFRunner:
    pads_rows = False  # a decode runs exactly the live slots: a padded row would cost a whole forward

    def __init__(self, model: torch.nn.Module, max_seq_len: int, kernels: str = "auto"):
        self.model = copy.deepcopy(model).eval()
        cfg = self.model.config
        weight = self.model.get_input_embeddings().weight
        self.dtype, self.device = weight.dtype, weight.device
        self.native = kernels_for(kernels, self.dtype, self.device)  # used for sampling only
        self.max_seq_len = max_seq_len
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self._names = set(self.model.state_dict())
        self._tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def new_cache(self, slots: int) -> SlotCaches:
        return SlotCaches(slots)

    @torch.no_grad()
    def prefill(self, rows: list[tuple[int, ...]]) -> list[object]:
        """Each row's HF cache after its tokens at positions 0..n-1 (no logits kept)."""
        out = []
        for row in rows:
            result = self.model(input_ids=torch.tensor([row], device=self.device), use_cache=True, logits_to_keep=1)
            out.append(result.cache)
        return out

    def place(self, cache: SlotCaches, kv: list[object], rows: list[int], slots: list[int]) -> None:
        """Slot `slots[i]` gets a copy of prefill row `rows[i]` (a decode extends its cache in place)."""
        for r, s in zip(rows, slots):
            cache.rows[s] = copy.deepcopy(kv[r])

    def stash_row(self, kv: list[object], row: int, length: int) -> list[object]:
        return [kv[row]]  # `place` copies, so the stash is never extended

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: SlotCaches,
        ranges: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """One token for each slot 0..B-1 at `positions` (B,), each on its own cache -> logits (B, V)."""
        logits = []
        for b, (token, position) in enumerate(zip(tokens.tolist(), positions.tolist())):
            past = cache.rows[b] if position > 0 else None  # position 0: a one-token prompt, nothing cached
            if past is not None and past.get_seq_length() != position:
                raise RuntimeError(
                    f"generic path: slot {b} caches {past.get_seq_length()} tokens but decodes position {position}"
                )
            result = self.model(input_ids=torch.tensor([[token]], device=self.device), cache=past, use_cache=True)
            cache.rows[b] = result.cache
            logits.append(result.logits[0, -1])
        return torch.stack(logits)  # (B, V)

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor], partial: bool = False) -> None:
        """Copy a full HF state dict in place; like the lean runner, a partial push is an error
        unless `partial` (a LoRA merge's changed weights)."""
        unknown = set(state) - self._names
        missing = set() if partial else self._names - set(state) - ({"lm_head.weight"} if self._tied else set())
        if unknown or missing:
            raise KeyError(
                f"weights do not match the engine's model: unknown {sorted(unknown)[:5]}, missing {sorted(missing)[:5]}"
            )
        own = self.model.state_dict()
        for name, tensor in state.items():
            own[name].copy_(tensor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()
