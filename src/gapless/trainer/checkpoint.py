"""Checkpoints: model in Hugging Face format, optimizer state and step, written atomically.

A checkpoint is complete or absent: it is written into a temporary directory, renamed into
place, and only then recorded in `latest` (itself replaced atomically). An interrupted run
therefore always leaves its last recorded checkpoint loadable by `--resume` or by any tool that
reads HF checkpoints (`AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_N")`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from gapless.models import Policy
from gapless.faults import fault_point


def save_checkpoint(run_dir: Path, policy: Policy, optimizer: torch.optim.Optimizer, step: int, extra: dict) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(tmp)
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


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer) -> dict:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
