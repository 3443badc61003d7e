"""Which engine path serves a checkpoint: the lean runner for the families it implements, else
the generic path that runs the HF module itself.

`layout_of(config)` reads an HF config and returns the `Layout` the lean runner (`runner.py`)
needs -- where the norms sit, whether queries and keys are normalised, each layer's sliding
window, the state-dict names of the fused projections -- or None with the reason it does not
apply. `engine_path` turns that into the path name and the one-line notice the engine logs.

Lean families: llama, qwen2, qwen3 (per-head q/k RMSNorm), mistral (sliding window), phi3
(fused qkv and gate_up weights), olmo2 (norms after attention and MLP, q/k RMSNorm over the whole
projection); all with SiLU-gated MLPs and a static RoPE over the full head dimension.
Everything else that `AutoModelForCausalLM` loads (gemma2, gemma3, ...) takes the generic path
(`hf_runner.py`): exact by construction, one HF forward per running sequence per step.
Guaranteed: a `Layout` is returned only for configs whose every feature the lean runner
implements; anything it does not recognise sends the model to the generic path, never to
silently different arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LEAN_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2")
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # their tables change with sequence length


@dataclass(frozen=True)
class Layout:
    """The lean runner's view of one family."""

    family: str
    qk_norm: Literal["none", "head", "full"]  # qwen3: per head over head_dim; olmo2: over all heads
    post_norms: bool  # olmo2: x + norm(attn(x)), x + norm(mlp(x)) instead of pre-norms
    fused_names: bool  # phi3: one qkv_proj and one gate_up_proj in the state dict
    windows: tuple[int | None, ...]  # per layer: sliding-window width in tokens, None = full attention


def layout_of(config) -> tuple[Layout | None, str]:
    """(layout, "") when the lean runner implements `config`, else (None, why not)."""
    family = config.model_type
    if family not in LEAN_FAMILIES:
        return None, f"model type {family!r} is not one of the lean runner's {LEAN_FAMILIES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return None, f"activation {config.hidden_act!r} (the lean runner's MLP is SiLU-gated)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in _POSITION_DEPENDENT_ROPE:
        return None, f"RoPE type {rope_type!r} depends on the sequence length"
    if float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        return None, "partial rotary embeddings"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return None, "logit soft-capping"
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and family != "mistral":  # mistral ignores layer_types
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    else:
        windows = (window,) * layers
    qk_norm = {"qwen3": "head", "olmo2": "full"}.get(family, "none")
    return Layout(family, qk_norm, family == "olmo2", family == "phi3", windows), ""


def require_engine(model) -> None:
    """ConfigError naming the checkpoint when the engine cannot run `model` (check_generic says why);
    every factory of an engine over a loaded checkpoint calls it before the first request."""
    if (why := check_generic(model)) is not None:
        from gapless.config import ConfigError

        path, kind = getattr(model.config, "_name_or_path", ""), model.config.model_type
        raise ConfigError(
            f"model.path {path}: the engine cannot run model type {kind!r} ({why}); "
            "docs/engine.md lists the families it serves"
        )


def check_generic(model) -> str | None:
    """Why the generic path cannot serve `model`, or None: one prefill and one cached decode
    step of its HF forward, as `hf_runner` runs them (cheap: two tokens)."""
    import torch

    if engine_path(model.config)[0] == "lean":
        return None
    try:
        with torch.no_grad():
            first = model(input_ids=torch.tensor([[0]]), use_cache=True, logits_to_keep=1)
            model(input_ids=torch.tensor([[0]]), cache=first.cache, use_cache=True)
    except Exception as err:  # any failure here is the model's code refusing the engine's calls
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
    return None


def engine_path(config) -> tuple[str, str]:
    """("lean" | "generic", the one-line notice to log)."""
    layout, why = layout_of(config)
    if layout is not None:
        return "lean", f"engine: lean runner for {layout.family} (native kernels where they build)"
    return (
        "generic",
        f"engine: generic path for {config.model_type} ({why}): the HF module under continuous batching, slower decode",
    )
