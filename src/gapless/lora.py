"""LoRA adapters on a Hugging Face causal LM: attach, read/write the adapter, merge into full weights.

    attach_lora(model, LoraSpec(rank, ...), name)  -> a peft model over a copy of `model`, with adapter `name`
                                                      (share_weights=True: the copy shares the frozen base tensors)
    check_targets(model, targets)                  -> ValueError naming the linear layers when a target matches none
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
`share_weights=True` copies the modules but not the base weights (the copy's frozen parameters
are the caller's own tensors, frozen there too): a trainer adapts a model without holding a
second copy of it, and the caller's module still computes the base function, since the base
weights never change; `merged_state` leaves the adapter unmerged (training continues) and its weights give the same
logits as the adapted model up to fp32 rounding; `adapter_state` holds only the adapter's
tensors, under names without the adapter's name, so a checkpoint loads into any adapter of the
same spec. Not guaranteed: adapters on the unembedding of a model whose LM head is tied to its
input embedding (`tie_word_embeddings`): one matrix cannot carry two different weights, so
`train_unembed` is ignored there (`LoraSpec.targets` says which modules are adapted). Module
names follow the Llama/Qwen2 families (q/k/v/o_proj, gate/up/down_proj, lm_head) unless
`LoraSpec.target_modules` names others. Not
thread-safe: one thread drives a shared model (activate, then forward/backward).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from gapless.config import ConfigError, LoraConfig

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
    target_modules: tuple[str, ...] | None = None  # set: exactly these (the train_* flags are ignored)
    dropout: float = 0.0  # peft's lora_dropout: active in train mode only

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets(self, model: torch.nn.Module) -> list[str]:
        """The module names to adapt in `model` (the unembedding only when it is not tied)."""
        if self.target_modules is not None:
            return list(self.target_modules)
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
        raise ValueError(
            "no module to adapt: set train_attn or train_mlp (train_unembed alone does nothing on a model "
            "with tied embeddings)"
        )
    if spec.target_modules is not None:  # named by the user: every name must adapt something
        check_targets(model, targets)
    return LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=spec.dropout, bias="none"
    )


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of `model`'s linear layers: what a target may name."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    available = linear_names(model)
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ValueError(f"{unknown} match no linear layer of this {model.config.model_type} model; it has {available}")
    if "lm_head" in targets and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "'lm_head' is tied to the input embedding in this model (tie_word_embeddings): one matrix "
            "cannot carry two weights; leave it out"
        )


def run_spec(cfg: LoraConfig, seed: int) -> LoraSpec | None:
    """The run's adapter (`[lora]`), None when `lora.rank` = 0 (full fine-tuning)."""
    if cfg.rank == 0:
        return None
    return LoraSpec(
        rank=cfg.rank, alpha=cfg.alpha, seed=seed, target_modules=tuple(cfg.target_modules), dropout=cfg.dropout
    )


def check_run_targets(cfg: LoraConfig, model: torch.nn.Module) -> None:
    """`lora.target_modules` against `model`, as a ConfigError naming the field (before any warm start)."""
    if cfg.rank == 0:
        return
    try:
        check_targets(model, list(cfg.target_modules))
    except ValueError as err:
        raise ConfigError(f"lora.target_modules: {err}") from None


def _seeded(spec: LoraSpec, build):
    if spec.seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return build()


def attach_lora(
    model: torch.nn.Module, spec: LoraSpec, name: str = "default", share_weights: bool = False
) -> torch.nn.Module:
    """A copy of `model` with adapter `name` on `spec.targets(model)`, active; only it requires grad.
    `share_weights`: the copy's base parameters are `model`'s own tensors (frozen), not copies."""
    from peft import get_peft_model

    config = _config(model, spec)
    memo = {id(p): p for p in model.parameters()} if share_weights else {}
    adapted = _seeded(spec, lambda: get_peft_model(copy.deepcopy(model, memo), config, adapter_name=name))
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
    return {
        _portable(key, name): p.detach().clone()
        for key, p in adapted.named_parameters()
        if "lora_" in key and f".{name}." in key
    }


def load_adapter_state(adapted: torch.nn.Module, state: dict[str, torch.Tensor], name: str = "default") -> None:
    params = {_portable(key, name): p for key, p in adapted.named_parameters() if "lora_" in key and f".{name}." in key}
    if set(state) != set(params):
        raise KeyError(
            f"adapter does not match this model: missing {sorted(set(params) - set(state))[:3]}, "
            f"unknown {sorted(set(state) - set(params))[:3]}"
        )
    with torch.no_grad():
        for key, tensor in state.items():
            if params[key].shape != tensor.shape:
                raise ValueError(
                    f"adapter tensor {key} has shape {tuple(tensor.shape)}, the model wants "
                    f"{tuple(params[key].shape)} (a different LoRA rank?)"
                )
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
