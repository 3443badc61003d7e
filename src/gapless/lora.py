"""LoRA adapters on a Hugging Face causal LM: attach, read/write the adapter, merge into full weights.

    attach_lora(model, LoraSpec(rank, ...), name)  -> a peft model over a copy of `model`, with adapter `name`
    add_lora(adapted, spec, name)                  -> another adapter on the same peft model (shared base)
    activate(adapted, name)                        -> the adapter forward passes use (and the only trainable one)
    adapter_parameters(adapted, name)              -> that adapter's tensors (what its optimizer steps)
    adapter_state(adapted, name)                   -> {portable name: tensor}: the adapter alone (a checkpoint)
    load_adapter_state(adapted, state, name)       -> put a saved adapter back (names and shapes must match)
    merged_state(adapted, name)                    -> the base model's HF-named state dict with W + scale * B @ A
                                                      folded in: what an engine (`TorchEngine.update_weights`) loads

Guaranteed: `attach_lora` deep-copies the base model once (the caller's module is never modified);
adapters added with `add_lora` share that copy's frozen weights, and each has its own tensors, so
training one never changes another (only the active adapter takes part in a forward pass and
requires grad); a freshly added adapter leaves the model's outputs unchanged (B starts at zero,
as in Hu et al. 2021), and with `seed` set its A matrices are the same on every call;
`merged_state` leaves the adapter unmerged (training continues) and its weights give the same
logits as the adapted model up to fp32 rounding; `adapter_state` holds only the adapter's
tensors, under names without the adapter's name, so a checkpoint loads into any adapter of the
same spec. Not guaranteed: adapters on the unembedding of a model whose LM head is tied to its
input embedding (`tie_word_embeddings`): one matrix cannot carry two different weights, so
`train_unembed` is ignored there (`LoraSpec.targets` says which modules are adapted). Module
names follow the Llama/Qwen2 families (q/k/v/o_proj, gate/up/down_proj, lm_head). Not
thread-safe: one thread drives a shared model (activate, then forward/backward).
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


def _config(model: torch.nn.Module, spec: LoraSpec):
    from peft import LoraConfig

    if spec.rank < 1:
        raise ValueError(f"LoRA rank must be at least 1 (got {spec.rank})")
    targets = spec.targets(model)
    if not targets:
        raise ValueError("no module to adapt: set train_attn or train_mlp (train_unembed alone does nothing on a model "
                         "with tied embeddings)")
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=0.0, bias="none")


def _seeded(spec: LoraSpec, build):
    if spec.seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return build()


def attach_lora(model: torch.nn.Module, spec: LoraSpec, name: str = "default") -> torch.nn.Module:
    """A copy of `model` with adapter `name` on `spec.targets(model)`, active; only it requires grad."""
    from peft import get_peft_model

    config = _config(model, spec)
    adapted = _seeded(spec, lambda: get_peft_model(copy.deepcopy(model), config, adapter_name=name))
    adapted.eval()  # no dropout anywhere: training and sampling see the same function
    return adapted


def add_lora(adapted: torch.nn.Module, spec: LoraSpec, name: str) -> None:
    """Another adapter on the same (shared, frozen) base; the active adapter does not change."""
    if name in adapted.peft_config:
        raise ValueError(f"an adapter named {name!r} exists already")
    active = adapted.active_adapter
    _seeded(spec, lambda: adapted.add_adapter(name, _config(adapted.get_base_model(), spec)))
    activate(adapted, active)
    adapted.eval()


def activate(adapted: torch.nn.Module, name: str) -> None:
    if adapted.active_adapter != name:
        adapted.set_adapter(name)


def remove_lora(adapted: torch.nn.Module, name: str) -> None:
    adapted.delete_adapter(name)


def adapter_parameters(adapted: torch.nn.Module, name: str = "default") -> list[torch.nn.Parameter]:
    return [p for key, p in adapted.named_parameters() if f".{name}." in key and "lora_" in key]


def _portable(key: str, name: str) -> str:
    return key.replace(f".{name}.", ".")


def adapter_state(adapted: torch.nn.Module, name: str = "default") -> dict[str, torch.Tensor]:
    return {_portable(key, name): p.detach().clone() for key, p in adapted.named_parameters()
            if "lora_" in key and f".{name}." in key}


def load_adapter_state(adapted: torch.nn.Module, state: dict[str, torch.Tensor], name: str = "default") -> None:
    params = {_portable(key, name): p for key, p in adapted.named_parameters() if "lora_" in key and f".{name}." in key}
    if set(state) != set(params):
        raise KeyError(f"adapter does not match this model: missing {sorted(set(params) - set(state))[:3]}, "
                       f"unknown {sorted(set(state) - set(params))[:3]}")
    with torch.no_grad():
        for key, tensor in state.items():
            if params[key].shape != tensor.shape:
                raise ValueError(f"adapter tensor {key} has shape {tuple(tensor.shape)}, the model wants "
                                 f"{tuple(params[key].shape)} (a different LoRA rank?)")
            params[key].copy_(tensor)


@torch.no_grad()
def merged_state(adapted: torch.nn.Module, name: str = "default") -> dict[str, torch.Tensor]:
    """The base model's state dict (HF names) with adapter `name` folded in; adapters stay separate."""
    from peft.tuners.lora import LoraLayer

    base = adapted.get_base_model()
    state = {key: t.detach().clone() for key, t in base.state_dict().items() if "lora_" not in key}
    state = {key.replace(".base_layer.", "."): t for key, t in state.items()}
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            key = f"{module_name}.weight"
            state[key] = state[key] + module.get_delta_weight(name)  # scale * B @ A, (out, in)
    return state
