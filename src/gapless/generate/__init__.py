"""Generators: the torch engine (default), the simple reference sampler, and the vLLM backend."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from gapless.config import ConfigError, GeneratorConfig
from gapless.generate.adapters import AdapterMerge
from gapless.generate.engine import TorchEngine
from gapless.generate.families import engine_path, require_engine
from gapless.generate.protocol import Generator, SteppedGenerator, StreamingGenerator
from gapless.generate.sampler import TorchSampler
from gapless.lora import LoraSpec
from gapless.models import Policy

__all__ = [
    "Generator",
    "SteppedGenerator",
    "StreamingGenerator",
    "TorchEngine",
    "TorchSampler",
    "make_generator",
    "serving_engine",
]


def make_generator(
    cfg: GeneratorConfig, policy: Policy, max_seq_len: int, work_dir: Path, log=print, lora: LoraSpec | None = None
) -> Generator:
    """A generator holding its own copy of `policy`'s weights, for contexts up to `max_seq_len` tokens.
    The torch engine's path (lean runner or generic) is logged in one line and recorded in
    `work_dir/generator.json`. `lora`: weight pushes are that adapter's tensors, merged into
    `policy.model`'s weights, which must stay the unchanged base (generate/adapters.py)."""
    require_engine(policy.model)
    generator = _make(cfg, policy, max_seq_len, work_dir, log, lora)
    if lora is not None and cfg.engine != "vllm":  # vLLM takes the adapter itself, as a LoRA request
        generator.adapters = AdapterMerge(policy.model, lora)
    return generator


def _make(
    cfg: GeneratorConfig, policy: Policy, max_seq_len: int, work_dir: Path, log, lora: LoraSpec | None
) -> Generator:
    if cfg.engine == "torch":
        path, notice = engine_path(policy.model.config)
        log(notice)
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        record = {"engine": "torch", "path": path, "model_type": policy.model.config.model_type, "notice": notice}
        (Path(work_dir) / "generator.json").write_text(json.dumps(record) + "\n")
        return TorchEngine(
            policy.model,
            policy.eos_id,
            policy.decode,
            max_batch=cfg.max_batch,
            max_seq_len=max_seq_len,
            kernels=cfg.kernels,
            stop_ids=policy.stop_ids,
            recompute_kv=cfg.recompute_kv,
            prefix_cache_mb=cfg.prefix_cache_mb,
        )
    if cfg.engine == "reference":
        return TorchSampler(copy.deepcopy(policy.model), policy.eos_id, policy.pad_id, policy.decode, policy.stop_ids)
    if cfg.engine == "vllm-server":
        return _vllm_server_engine(cfg, policy, max_seq_len, Path(work_dir) / "vllm-server", log)
    # vLLM builds its model from a directory; one per process (the trainer's eval engine and each
    # generator actor build their own)
    path = Path(work_dir) / "vllm" / f"policy-{os.getpid()}"
    return _vllm_engine(policy, path, True, cfg.max_batch, max_seq_len, policy.stop_ids, cfg.recompute_kv, lora, log)


def serving_engine(
    engine: str,
    policy: Policy,
    *,
    max_batch: int,
    max_seq_len: int | None,
    model_dir: str | Path,
    kernels: str = "auto",
    save: bool = False,
    prefix_cache_mb: int = 0,
    log=print,
) -> StreamingGenerator:
    """The engine a request scheduler drives (`gapless serve`, the Tinker service's samplers):
    'torch' (the torch engine over a copy of `policy`'s weights) or 'vllm' (vLLM loading
    `model_dir`, where `policy` is saved first if `save` or no checkpoint is there). No stop tokens of
    its own: every request names its stops (serve/scheduler.py). `max_seq_len` None: the model's.
    `prefix_cache_mb`: the torch engine's prefix cache (0 = off; vLLM keeps its own)."""
    if engine == "torch":
        return TorchEngine(
            policy.model,
            policy.eos_id,
            policy.decode,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            kernels=kernels,
            prefix_cache_mb=prefix_cache_mb,
        )
    if engine != "vllm":
        raise ValueError(f"unknown serving engine {engine!r}: 'torch' or 'vllm'")
    model_dir = Path(model_dir)
    save = save or not (model_dir / "config.json").exists()
    return _vllm_engine(policy, model_dir, save, max_batch, max_seq_len, (), False, None, log)


def _vllm_engine(
    policy: Policy, path: Path, save: bool, max_batch: int, max_seq_len: int, stop_ids, recompute_kv: bool, lora, log
) -> StreamingGenerator:
    from gapless.generate.vllm.engine import VLLMEngine, check_model, on_cpu

    check_model(head_dim(policy.model.config))  # before anything is written or built
    if save:
        policy.save(path)
        _fit_positions(path, max_seq_len)
    # CPU: the policy's own dtype (fp32 keeps log-probs equal to the trainer's); GPU: model.dtype 'auto' is bf16
    dtype = str(policy.model.dtype).removeprefix("torch.") if on_cpu() else "bfloat16"
    engine = VLLMEngine(
        str(path),
        policy.eos_id,
        policy.decode,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        stop_ids=stop_ids,
        dtype=dtype,
        recompute_kv=recompute_kv,
        lora_rank=lora.rank if lora is not None else 0,
        lora_alpha=lora.alpha if lora is not None else 32.0,
        lora_dir=str(path) + "-lora",
    )
    log(
        f"generator: vLLM {engine.vllm_version} ({'CPU' if on_cpu() else 'GPU'}, {dtype}), weights by "
        f"{'LoRA requests' if lora is not None else engine.weights.full.name}"
    )
    return engine


def _vllm_server_engine(cfg: GeneratorConfig, policy: Policy, max_seq_len: int, root: Path, log) -> Generator:
    """A `VLLMServerEngine` on the server at `cfg.vllm_url`, or on one started here over a copy of
    `policy` (stopped when this process exits)."""
    import atexit

    from gapless.generate.vllm.engine import VLLMUnavailable, check_model, on_cpu
    from gapless.generate.vllm.remote import VLLMServerEngine
    from gapless.generate.vllm.server import VLLMServer

    tag = f"{os.getpid()}"
    if cfg.vllm_url is not None:
        try:
            server = VLLMServer.attach(cfg.vllm_url)
        except VLLMUnavailable as exc:  # the URL is configuration: one line, exit 2
            raise ConfigError(str(exc)) from None
    else:
        check_model(head_dim(policy.model.config))
        path = root / f"policy-{tag}"
        policy.save(path)
        _fit_positions(path, max_seq_len)
        dtype = str(policy.model.dtype).removeprefix("torch.") if on_cpu() else "bfloat16"
        log(f"generator: starting vllm serve over {path} ({dtype}); its log: {root / f'server-{tag}.log'}")
        server = VLLMServer.start(
            path,
            root / f"server-{tag}.log",
            dtype=dtype,
            max_batch=cfg.max_batch,
            max_seq_len=max_seq_len,
            threads=torch.get_num_threads(),
        )
    engine = VLLMServerEngine(
        server,
        policy.eos_id,
        policy.decode,
        weights_dir=root / f"weights-{tag}",
        max_batch=cfg.max_batch,
        max_seq_len=max_seq_len,
        stop_ids=policy.stop_ids,
    )
    atexit.register(engine.close)
    if cfg.vllm_url is not None:  # an attached server holds whatever it was started on: the policy's weights now
        engine.update_weights(policy.model.state_dict(), 0)
    log(f"generator: vLLM server at {server.url}, weights by {engine.weights.name} (pause, reload_weights, resume)")
    return engine


def _fit_positions(path: Path, max_seq_len: int | None) -> None:
    """vLLM refuses a context longer than the checkpoint's `max_position_embeddings`, which the
    trainer and the torch engine run past (a multi-turn episode's context on the embedded model).
    Under plain RoPE a position's rotation does not depend on that field, so vLLM's copy of the
    config gets `max_seq_len` there; a scaled RoPE does depend on it: a one-line error instead."""
    config_path = path / "config.json"
    hf = json.loads(config_path.read_text())
    if not max_seq_len or max_seq_len <= hf.get("max_position_embeddings", max_seq_len):
        return
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(
            f"the run's context is {max_seq_len} tokens, past this model's max_position_embeddings "
            f"({hf['max_position_embeddings']}) under a scaled RoPE, which vLLM does not extend: shorten "
            "generator.max_new_tokens (or the episode's turns), or use generator.engine = 'torch'"
        )
    hf["max_position_embeddings"] = max_seq_len
    config_path.write_text(json.dumps(hf, indent=2) + "\n")


def head_dim(config) -> int:
    """The attention head width of an HF config (its `head_dim`, else hidden_size / num_attention_heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
