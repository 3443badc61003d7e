"""Checkpoints: model in Hugging Face format, optimizer state and step, written atomically.

A checkpoint is complete or absent: it is written into a temporary directory, renamed into
place, and only then recorded in `latest` (itself replaced atomically). An interrupted run
therefore always leaves its last recorded checkpoint loadable by `--resume` or by any tool that
reads HF checkpoints (`AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_N")`).

A LoRA run's checkpoint holds the peft adapter instead of the model (`adapter_config.json`,
`adapter_model.safetensors`, beside the tokenizer, optimizer and step), and the frozen base it
adapts is written once per run, atomically too, to `checkpoints/base` (a plain HF checkpoint):

    base = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "base")
    model = PeftModel.from_pretrained(base, run_dir / "checkpoints" / "step_N")   # the trained policy
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from gapless.config import ConfigError
from gapless.faults import fault_point
from gapless.lora import load_adapter_state
from gapless.models import Policy, save_tokenizer

BASE = "base"  # a LoRA run's frozen base model, beside its step_N adapter checkpoints
ADAPTER_FILE = "adapter_model.safetensors"  # peft's name


def save_checkpoint(
    run_dir: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict,
    adapted: torch.nn.Module | None = None,
) -> Path:
    """`adapted`: a LoRA run's peft model (its adapter is saved; `policy.model` is its base)."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    if adapted is None:
        policy.save(tmp)
    else:
        if not (root / BASE / "config.json").is_file():
            base_tmp = root / f".tmp_{BASE}"
            shutil.rmtree(base_tmp, ignore_errors=True)
            policy.save(base_tmp)
            shutil.rmtree(root / BASE, ignore_errors=True)
            os.replace(base_tmp, root / BASE)
        adapted.save_pretrained(tmp)
        save_tokenizer(policy.tokenizer, tmp)
    fault_point("trainer", "checkpoint")  # model written; optimizer, state and rename still to come
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **extra}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_atomic(root / "latest", final.name)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if path.is_dir() else None


def checkpoint_model_dir(checkpoint: Path, is_lora: bool) -> Path:
    """Where `--resume` loads the policy model from: the checkpoint itself, or a LoRA run's base."""
    has_adapter = (checkpoint / ADAPTER_FILE).is_file()
    if has_adapter != is_lora:
        raise ConfigError(
            f"--resume: {checkpoint} holds {'a LoRA adapter' if has_adapter else 'full weights'} but this run has "
            f"lora.rank = {'0' if not is_lora else 'above 0'}; resume with the config the run was started with"
        )
    return checkpoint.parent / BASE if is_lora else checkpoint


def load_checkpoint_adapter(checkpoint: Path, adapted: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    try:
        load_adapter_state(adapted, load_file(checkpoint / ADAPTER_FILE))
    except (KeyError, ValueError) as err:
        raise ConfigError(
            f"--resume: the adapter in {checkpoint} does not fit this run's [lora] settings ({err})"
        ) from None


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer) -> dict:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
