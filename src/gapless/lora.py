"""LoRA adapters on a Hugging Face causal LM: attach, read/write the adapter, merge into full weights.

    attach_lora(model, LoraSpec(rank, ...))  -> a peft model whose only trainable tensors are the adapters
    adapter_state(peft_model)                -> {name: tensor}: the adapter alone (a checkpoint's payload)
    load_adapter_state(peft_model, state)    -> put a saved adapter back (names and shapes must match)
    merged_state(peft_model)                 -> the base model's HF-named state dict with W + scale * B @ A
                                                folded in: what an engine (`TorchEngine.update_weights`) loads

Guaranteed: `attach_lora` deep-copies the base model (the caller's module is never modified, so
several adapters can share one base); a freshly attached adapter leaves the model's outputs
unchanged (B starts at zero, as in Hu et al. 2021), and with `seed` set its A matrices are the
same on every call; `merged_state` leaves the adapter unmerged (training continues) and its
weights give the same logits as the adapted model up to fp32 rounding. `adapter_state` holds
only the adapter tensors, so it is small beside the base model.
Not guaranteed: adapters on the unembedding of a model whose LM head is tied to its input
embedding (`tie_word_embeddings`): one matrix cannot carry two different weights, so
`train_unembed` is ignored there (`LoraSpec.targets` says which modules were adapted).
Module names follow the Llama/Qwen2 families (q/k/v/o_proj, gate/up/down_proj, lm_head).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = 32.0  # scale = alpha / rank, as peft defines it
    seed: int | None = None

    def targets(self, model: torch.nn.Module) -> list[str]:
        """The module names to adapt in `model` (the unembedding only when it is not tied)."""
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        names = (ATTENTION if self.train_attn else ()) + (MLP if self.train_mlp else ())
        names += UNEMBED if self.train_unembed and not tied else ()
        return list(names)


def attach_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """A copy of `model` with adapters on `spec.targets(model)`; only the adapters require grad."""
    from peft import LoraConfig, get_peft_model

    if spec.rank < 1:
        raise ValueError(f"LoRA rank must be at least 1 (got {spec.rank})")
    targets = spec.targets(model)
    if not targets:
        raise ValueError("no module to adapt: set train_attn or train_mlp (train_unembed alone does nothing on a model "
                         "with tied embeddings)")
    base = copy.deepcopy(model)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    if spec.seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            adapted = get_peft_model(base, config)
    else:
        adapted = get_peft_model(base, config)
    adapted.eval()  # no dropout anywhere: training and sampling see the same function
    return adapted


def adapter_state(adapted: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in adapted.named_parameters() if "lora_" in name}


def load_adapter_state(adapted: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(adapted.named_parameters())
    expected = {name for name in params if "lora_" in name}
    if set(state) != expected:
        raise KeyError(f"adapter does not match this model: missing {sorted(expected - set(state))[:3]}, "
                       f"unknown {sorted(set(state) - expected)[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"adapter tensor {name} has shape {tuple(tensor.shape)}, the model wants "
                                 f"{tuple(params[name].shape)} (a different LoRA rank?)")
            params[name].copy_(tensor)


@torch.no_grad()
def merged_state(adapted: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict (HF names) with every adapter folded in; the adapter stays separate."""
    from peft.tuners.lora import LoraLayer

    base = adapted.get_base_model()
    state = {name: t.detach().clone() for name, t in base.state_dict().items() if "lora_" not in name}
    for module_name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = f"{module_name}.base_layer.weight"
        delta = module.get_delta_weight("default")  # scale * B @ A, (out, in)
        state[f"{module_name}.weight"] = state.pop(key) + delta
    return {name.replace(".base_layer.", "."): t for name, t in state.items()}
