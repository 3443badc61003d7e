"""gapless/lora.py's guarantees on a tiny Qwen2 model: a fresh adapter changes nothing, the seed
fixes it, the base is never modified, merged weights give the adapted logits, an adapter saved and
loaded back is the same function, and a tied unembedding is left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from serve_model import tiny_policy

from gapless.lora import (
    LoraSpec,
    activate,
    adapter_parameters,
    adapter_state,
    add_lora,
    attach_lora,
    load_adapter_state,
    merged_state,
)

IDS = torch.tensor([[1, 5, 7, 9, 11, 13]])


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _perturb(adapted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_fresh_adapter_is_identity_and_seeded():
    policy = tiny_policy()
    base = {k: v.clone() for k, v in policy.model.state_dict().items()}
    a, b = attach_lora(policy.model, LoraSpec(rank=4, seed=3)), attach_lora(policy.model, LoraSpec(rank=4, seed=3))
    assert torch.equal(_logits(a), _logits(policy.model))  # B = 0
    assert all(torch.equal(x, y) for x, y in zip(adapter_state(a).values(), adapter_state(b).values()))
    assert {id(p) for p in a.parameters() if p.requires_grad} == {id(p) for p in adapter_parameters(a)}
    _perturb(a)
    assert all(torch.equal(base[k], v) for k, v in policy.model.state_dict().items())  # the base is a copy


def test_merged_state_and_adapter_round_trip():
    policy = tiny_policy()
    adapted = attach_lora(policy.model, LoraSpec(rank=4, seed=0))
    _perturb(adapted)
    merged = copy.deepcopy(policy.model)
    merged.load_state_dict(merged_state(adapted))
    assert (_logits(merged) - _logits(adapted)).abs().max() < 1e-5
    assert not torch.equal(_logits(merged), _logits(policy.model))
    other = attach_lora(policy.model, LoraSpec(rank=4, seed=1))
    load_adapter_state(other, adapter_state(adapted))
    assert torch.equal(_logits(other), _logits(adapted))
    with pytest.raises(ValueError, match="a different LoRA rank"):
        load_adapter_state(attach_lora(policy.model, LoraSpec(rank=2)), adapter_state(adapted))


def test_targets_follow_the_flags_and_skip_a_tied_head():
    policy = tiny_policy()  # tie_word_embeddings = True
    assert LoraSpec(rank=2, train_mlp=False).targets(policy.model) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert "lm_head" not in LoraSpec(rank=2).targets(policy.model)
    with pytest.raises(ValueError, match="no module to adapt"):
        attach_lora(policy.model, LoraSpec(rank=2, train_attn=False, train_mlp=False))


def test_adapters_on_one_shared_base_stay_apart():
    policy = tiny_policy()
    shared = attach_lora(policy.model, LoraSpec(rank=4, seed=0), "a")
    add_lora(shared, LoraSpec(rank=2, train_mlp=False, seed=1), "b")
    assert shared.active_adapter == "a"
    _perturb(shared)  # both adapters' B
    activate(shared, "a")
    logits_a = _logits(shared)
    assert {id(p) for p in adapter_parameters(shared, "a")}.isdisjoint(id(p) for p in adapter_parameters(shared, "b"))
    activate(shared, "b")
    assert not torch.equal(_logits(shared), logits_a)
    assert all(p.requires_grad for p in adapter_parameters(shared, "b"))
    assert not any(p.requires_grad for p in adapter_parameters(shared, "a"))
    activate(shared, "a")
    assert torch.equal(_logits(shared), logits_a)  # b's weights take no part in a's forward
    alone = attach_lora(policy.model, LoraSpec(rank=4, seed=0), "x")
    load_adapter_state(alone, adapter_state(shared, "a"), "x")  # portable names: a checkpoint loads anywhere
    assert torch.equal(_logits(alone), logits_a)
    merged = copy.deepcopy(policy.model)
    merged.load_state_dict(merged_state(shared, "b"))
    activate(shared, "b")
    assert (_logits(merged) - _logits(shared)).abs().max() < 1e-5
