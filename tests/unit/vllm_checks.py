"""What the vLLM tests compare against: HF `generate`'s greedy tokens, and a policy with its weights
moved by a seeded perturbation (a new version to push)."""

from __future__ import annotations

import copy

import torch


def hf_greedy(model, policy, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=policy.pad_id,
            eos_token_id=policy.eos_id,
        )
    return out[0, len(prompt) :].tolist()


def perturbed(policy, seed: int):
    model = copy.deepcopy(policy.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model
