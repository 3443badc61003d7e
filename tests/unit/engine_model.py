"""The engine tests' model: the suite's tiny shape (2 layers, 4 heads over 2 KV heads, hidden 32)
in any architecture the engine serves, with a tokenizer trained on `texts`; each test module
perturbs its weights its own way."""

from __future__ import annotations

from gapless.config import ModelConfig
from gapless.models import Policy, build_tiny


def tiny_in(architecture: str, texts: list[str]) -> Policy:
    cfg = ModelConfig(
        architecture=architecture,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        vocab_size=300,
    )
    return build_tiny(cfg, texts, seed=0)
