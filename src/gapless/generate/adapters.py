"""LoRA on the generator side: the trainer pushes adapter tensors, the engine merges them.

In a LoRA run (`[lora]`, lora.py) the trainer's push holds only the adapters: A (r, in) and
B (out, r) of every adapted linear layer, under peft's names (`lora.adapter_state`). The
generator keeps its base weights W0 and loads, for each adapted layer, the merged weight

    W = W0 + (alpha / rank) * B @ A          (Hu et al. 2021; the scale as peft defines it)

computed in float32 from W0 each time, then cast to the weight's dtype.

Merged, not a LoRA path in the engine, because decoding then runs exactly the full-weight
path (the lean runner's fused q/k/v and gate/up matrices, its packed and native kernels, the
generic runner's HF modules) at no cost per token; a LoRA path would add two thin matmuls per
adapted layer per token, memory-bound on a CPU, and a second variant of every kernel. The
merge costs one pass over the adapted weights per policy version (bench/real_shapes.py), paid
once per step while decoding runs for the whole step. Only one adapter is ever live in
training, so serving many adapters at once (the reason engines keep LoRA unmerged) does not
arise here.

W0 is read from the model the engine was built from (`base`: the generator's own policy copy,
or in the trainer's process the frozen base the trainer's adapters sit on): the merge keeps no
second copy of it.

Guaranteed: every merge starts from W0, so versions never accumulate rounding; a push that
names a layer the base lacks, or misses a B for an A, raises KeyError before any weight is
written; versions and the never-torn guarantee are the transport's (cluster/weights.py), which carries
adapter tensors like any state dict. Not guaranteed: bitwise equality with the trainer's
unmerged forward, x W0^T + s (x A^T) B^T, which rounds differently from x W^T (within float32
rounding; the engine's log-probs still equal the trainer's within 1e-5, tested).
"""

from __future__ import annotations

from typing import Callable

import torch

from gapless.lora import LoraSpec

PREFIX = "base_model.model."  # peft's wrapper and its LoraModel, before the HF module names
A, B = ".lora_A.weight", ".lora_B.weight"


class AdapterMerge:
    def __init__(self, base: torch.nn.Module, spec: LoraSpec):
        self.base = base.state_dict()  # views of the base's tensors, read only
        self.scale = spec.scale

    def layers(self, adapters: dict[str, torch.Tensor]) -> list[str]:
        """HF module names of the adapted layers in a push, after checking it is complete."""
        names = [key[len(PREFIX) : -len(A)] for key in adapters if key.endswith(A)]
        expected = {PREFIX + n + suffix for n in names for suffix in (A, B)}
        if set(adapters) != expected or not names:
            raise KeyError(
                f"not a LoRA push: unexpected {sorted(set(adapters) - expected)[:3]}, "
                f"missing {sorted(expected - set(adapters))[:3]}"
            )
        unknown = [n for n in names if n + ".weight" not in self.base]
        if unknown:
            raise KeyError(f"adapters for layers the base model lacks: {unknown[:3]}")
        return names

    @torch.no_grad()
    def merged(self, adapters: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
        w0 = self.base[layer + ".weight"]  # (out, in)
        a, b = adapters[PREFIX + layer + A].float(), adapters[PREFIX + layer + B].float()  # (r, in), (out, r)
        return torch.addmm(w0.float(), b, a, alpha=self.scale).to(w0.dtype)

    def load(self, adapters: dict[str, torch.Tensor], load_partial: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Load every adapted layer's merged weight through `load_partial`, one layer at a time
        (so at most one merged matrix exists beside the engine's weights)."""
        for layer in self.layers(adapters):
            load_partial({layer + ".weight": self.merged(adapters, layer)})
