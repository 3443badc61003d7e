"""A tiny locally built policy for the serving tests: random but peaked weights, so sampled and
greedy outputs vary instead of repeating one token; context 256 tokens."""

from __future__ import annotations

import copy

import torch

from gapless.config import ModelConfig
from gapless.models import Policy, build_tiny

TEXTS = [f"Question {i}: name {i % 7} fruits, colours or animals. Answer: apple, red, cat, {i}." for i in range(40)]


def tiny_policy(seed: int = 0, max_positions: int = 256) -> Policy:
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    policy = build_tiny(cfg, TEXTS, seed=seed, max_positions=max_positions)
    model = copy.deepcopy(policy.model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    policy.model = model
    return policy
