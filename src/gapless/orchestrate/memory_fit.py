"""Will the run fit in memory? An estimate of the trainer's and the engine's peak, checked at start.

`estimate_memory(cfg, shape, max_seq_len)` prices, from the model's shape and the run's config:
    trainer   weights, gradients and AdamW's two moments (of the trained parameters), the frozen
              reference copy when the KL term needs one, the activations one micro-batch keeps
              for its backward (per token and layer: ~6 x hidden + 2.5 x intermediate values, or
              one hidden vector with gradient checkpointing), and the logits: the whole
              (tokens x vocab) of a padded micro-batch three times over (logits, their gradient,
              a row's transient), or one chunk's (chunked_head.py) when micro-batches are packed;
    engine    its own copy of the weights and the KV cache it can grow to: slots (the rows in
              flight, at most generator.max_batch) x layers x 2 x kv_heads x head_dim x max_seq_len.
A micro-batch holds, padded, min(micro_batch_size, rows per step) x the longest row; packed,
max(max_tokens_per_micro_batch, the longest row). `check_fits` prints the estimate and refuses
a run whose estimate passes the memory available (the cgroup's limit or MemAvailable) with a
`ConfigError` naming the knob that shrinks its largest term.

Guaranteed: the check runs before any rollout, and a refusal names a field. Not guaranteed: the
estimate is a model, not a measurement; it leaves out the Python interpreter, the environment's
workers and allocator fragmentation (about 1 GB a process here), and a multi-turn episode's
context is priced at its configured bound. The held-out eval's engine (in the trainer's process) is
not priced: its cache grows with the longest answer so far (kv_cache.py), small for a policy that
stops, up to min(generator.max_batch, eval prompts) x max_seq_len for one whose greedy answers
run to generator.max_new_tokens. The run's peak RSS (`perf/peak_rss_mb`) checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gapless.config import Config, ConfigError

GB = 1 << 30
ACTIVATION_HIDDEN, ACTIVATION_INTERMEDIATE = 6.0, 2.5  # values kept per token and layer, x hidden / intermediate
PROCESS_BYTES = 1 * GB  # interpreter, torch and allocator slack, per process


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_value: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        c = model.config
        heads = c.num_attention_heads
        return cls(
            params=sum(p.numel() for p in model.parameters()),
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            intermediate=getattr(c, "intermediate_size", 4 * c.hidden_size),
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab=c.vocab_size,
            bytes_per_value=next(model.parameters()).element_size(),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    trainer_state: int  # weights, gradients, AdamW moments, reference copy
    activations: int  # one micro-batch's, kept for its backward
    logits: int
    engine_weights: int
    kv_cache: int
    micro_batch_tokens: int
    kv_slots: int

    @property
    def trainer(self) -> int:
        return self.trainer_state + self.activations + self.logits + PROCESS_BYTES

    @property
    def engine(self) -> int:
        return self.engine_weights + self.kv_cache + PROCESS_BYTES

    @property
    def total(self) -> int:
        return self.trainer + self.engine

    def describe(self) -> str:
        return (
            f"memory estimate {self.total / GB:.2f} GB: trainer {self.trainer / GB:.2f} GB (state "
            f"{self.trainer_state / GB:.2f}, activations {self.activations / GB:.2f} for {self.micro_batch_tokens} "
            f"tokens a micro-batch, logits {self.logits / GB:.2f}), engine {self.engine / GB:.2f} GB (weights "
            f"{self.engine_weights / GB:.2f}, KV cache {self.kv_cache / GB:.2f} for {self.kv_slots} sequences)"
        )


def estimate_memory(
    cfg: Config, shape: ModelShape, max_seq_len: int, trained_params: int | None = None
) -> MemoryEstimate:
    """`max_seq_len`: the longest row (prompt + completion); `trained_params`: the optimizer's
    parameters when fewer than the model's (a LoRA run)."""
    t, b = cfg.trainer, shape.bytes_per_value
    weights = shape.params * b
    trained = (shape.params if trained_params is None else trained_params) * b
    reference = weights if t.kl_coef > 0 and cfg.lora.rank == 0 else 0
    rows = cfg.loop.prompts_per_step * cfg.generator.group_size
    if t.max_tokens_per_micro_batch > 0:
        tokens = max(t.max_tokens_per_micro_batch, max_seq_len)
        from gapless.trainer.chunked_head import chunk_positions

        logits = 4 * min(chunk_positions(shape.vocab), tokens) * shape.vocab * 4
    else:
        tokens = min(t.micro_batch_size, rows) * max_seq_len
        logits = 3 * tokens * shape.vocab * 4
    per_token = (
        shape.hidden
        if t.gradient_checkpointing
        else ACTIVATION_HIDDEN * shape.hidden + ACTIVATION_INTERMEDIATE * shape.intermediate
    )
    activations = int(tokens * shape.layers * per_token * b)
    slots = min(cfg.generator.max_batch, rows * (1 + cfg.pipeline.max_staleness))
    kv = slots * shape.layers * 2 * shape.kv_heads * shape.head_dim * max_seq_len * b
    kv += cfg.generator.prefix_cache_mb << 20  # the engine's prefix cache holds up to its budget
    return MemoryEstimate(weights + 3 * trained + reference, activations, logits, weights, kv, tokens, slots)


def available_bytes() -> int:
    """What this process may still allocate: MemAvailable, or less under a cgroup (v2) limit."""
    available = _meminfo("MemAvailable") or 0
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    try:
        text = limit.read_text().strip()
        if text != "max":
            available = min(available or 1 << 62, int(text) - int(used.read_text()))
    except (OSError, ValueError):
        pass
    return available


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(
    cfg: Config, model: torch.nn.Module, max_seq_len: int, log=print, available: int | None = None
) -> MemoryEstimate:
    """Print the estimate; raise a ConfigError naming the knob when it passes `available`."""
    shape = ModelShape.of(model)
    trained = None
    if cfg.lora.rank:  # the adapters are attached later: rank x (in + out) per adapted layer, ~hidden each
        trained = cfg.lora.rank * 2 * shape.hidden * len(cfg.lora.target_modules) * shape.layers
    est = estimate_memory(cfg, shape, max_seq_len, trained)
    available = available_bytes() if available is None else available
    log(f"{est.describe()}; available {available / GB:.2f} GB")
    if available and est.total > available:
        raise ConfigError(
            f"the run needs about {est.total / GB:.1f} GB but {available / GB:.1f} GB are available "
            f"({est.describe()}): {_knob(cfg, est)}"
        )
    return est


def _knob(cfg: Config, est: MemoryEstimate) -> str:
    """The field that shrinks the largest term."""
    terms = {
        "activations": est.activations + est.logits,
        "kv": est.kv_cache,
        "state": est.trainer_state + est.engine_weights,
    }
    largest = max(terms, key=terms.__getitem__)
    if largest == "kv":
        return (
            f"lower generator.max_batch (now {cfg.generator.max_batch}; the KV cache holds {est.kv_slots} sequences) "
            f"or generator.max_new_tokens (now {cfg.generator.max_new_tokens})"
            + (
                f", or generator.prefix_cache_mb (now {cfg.generator.prefix_cache_mb})"
                if cfg.generator.prefix_cache_mb
                else ""
            )
        )
    if largest == "state":
        return "the model itself does not fit: train LoRA adapters (lora.rank > 0) or use model.dtype = 'bfloat16'"
    if cfg.trainer.max_tokens_per_micro_batch == 0:
        return (
            f"set trainer.max_tokens_per_micro_batch (packed micro-batches with a chunked LM head; now "
            f"{cfg.trainer.micro_batch_size} rows x the longest row a micro-batch) or lower trainer.micro_batch_size"
        )
    return (
        f"lower trainer.max_tokens_per_micro_batch (now {cfg.trainer.max_tokens_per_micro_batch}; a row longer "
        f"than it trains alone), set trainer.gradient_checkpointing = true, or lower generator.max_new_tokens"
    )
