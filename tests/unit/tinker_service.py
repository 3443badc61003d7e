"""The Tinker service for the tests: a tiny saved base model (`tiny`), served in this process by
the app `gapless serve-training` runs, with settings a test may override. The tokenizer is not
exported to the Hugging Face cache (the user's cache is not the tests')."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from serve_model import tiny_policy

from gapless.config import load_config
from gapless.models import Policy
from gapless.service.server import ServiceThread, build_service

KEY = "tml-gapless-test"


@contextmanager
def served(root: Path, **settings: str) -> Iterator[tuple[ServiceThread, Policy]]:
    """Serve `tiny` saved under `root/base`, checkpoints under `root/ckpt`; `settings`: [service]
    fields as command-line values (`max_seq_len="64"`)."""
    torch.set_num_threads(1)
    policy = tiny_policy()
    policy.save(root / "base")
    overrides = {
        "service.base_models": f'{{tiny = "{root / "base"}"}}',
        "service.checkpoint_dir": f'"{root / "ckpt"}"',
        "service.max_batch": "8",
        "service.max_seq_len": "128",
        "service.poll_hold_s": "5",
        "service.export_tokenizers": "false",
        **{f"service.{name}": value for name, value in settings.items()},
    }
    server = ServiceThread(build_service(load_config(None, overrides), KEY, log=lambda *a, **k: None))
    try:
        yield server, policy
    finally:
        server.close()
