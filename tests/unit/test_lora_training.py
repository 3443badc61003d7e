"""LoRA in the training run (`[lora]`): the trainer steps only the adapters, on the base's own
tensors; the push is the adapters alone (bytes in closed form); the engine that merges them
samples with the trainer's log-probs; the checkpoint is a peft adapter that PeftModel loads to
the same log-probs; the KL reference is the base with adapters disabled; bad targets name the field."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gapless.config import ConfigError, LoraConfig, TrainerConfig, load_config
from gapless.generate.adapters import AdapterMerge
from gapless.generate.engine import TorchEngine
from gapless.lora import LoraSpec, check_run_targets, run_spec
from gapless.models import load_local
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.trainer.checkpoint import checkpoint_model_dir, load_checkpoint_adapter, save_checkpoint
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import SamplingParams

GROUP_SIZE, MAX_NEW_TOKENS = 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _spec(rank=4, **kw) -> LoraSpec:
    return LoraSpec(rank=rank, seed=0, target_modules=TARGETS, **kw)


@pytest.fixture
def base(tiny_policy):
    policy = copy.copy(tiny_policy)
    policy.model = copy.deepcopy(tiny_policy.model)
    return policy


def _batch(policy, problems, engine=None, seed=5):
    """3 groups of 4 sampled by `engine` (default a torch engine over the policy), random advantages."""
    engine = engine or TorchEngine(policy.model, policy.eos_id, max_batch=16, max_seq_len=128)
    prompts = [policy.encode(p.prompt) for p in problems[:3] for _ in range(GROUP_SIZE)]
    completions = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=seed))
    advantages = torch.randn(len(completions), generator=torch.Generator().manual_seed(0)).tolist()
    return build_batch(
        completions,
        advantages,
        [True] * len(completions),
        policy.pad_id,
        [i // GROUP_SIZE for i in range(len(completions))],
    )


def _trainer(policy, cfg=None, spec=None) -> GRPOTrainer:
    return GRPOTrainer(policy.model, cfg or TrainerConfig(lr=1e-2), max_new_tokens=MAX_NEW_TOKENS, lora=spec or _spec())


def _push_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_the_optimizer_holds_only_the_adapters_and_the_base_is_shared_and_frozen(base, problems):
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    trainer = _trainer(base)
    adapters = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapters} and len(
        adapters
    ) == 2 * 7 * 2  # A, B x 7 targets x 2 layers
    base_ptrs = {p.data_ptr() for p in base.model.parameters()}
    frozen = {p.data_ptr() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert frozen == base_ptrs  # the trainer adapts the policy's own tensors: no second copy
    stats = trainer.step(_batch(base, problems))
    assert stats.num_tokens > 0 and stats.grad_norm > 0
    assert all(torch.equal(before[k], v) for k, v in base.model.state_dict().items())  # the base never moves
    assert any(float(p.detach().abs().sum()) > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_gradient_checkpointing_and_bfloat16_keep_working(base, problems, tiny_policy):
    batch = _batch(base, problems)
    plain = _trainer(base)
    plain.step(batch)
    other = copy.copy(tiny_policy)
    other.model = copy.deepcopy(tiny_policy.model)
    checkpointed = _trainer(other, TrainerConfig(lr=1e-2, gradient_checkpointing=True))
    checkpointed.step(batch)
    for (name, a), b in zip(plain.state_for_push().items(), checkpointed.state_for_push().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    half = copy.copy(tiny_policy)
    half.model = copy.deepcopy(tiny_policy.model).to(torch.bfloat16)
    stats = _trainer(half).step(batch)
    assert stats.num_tokens > 0 and torch.isfinite(torch.tensor(stats.grad_norm))
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())


def test_the_push_is_the_adapters_alone_in_proportion_to_the_rank(base):
    cfg = base.model.config
    hidden, inter, kv = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads),
    )
    # per layer, r * (in + out) for each target: q, o (h, h); k, v (h -> kv); gate, up (h -> inter); down (inter -> h)
    per_rank = cfg.num_hidden_layers * (2 * 2 * hidden + 2 * (hidden + kv) + 3 * (hidden + inter))
    for rank in (2, 4, 8):
        state = _trainer(base, spec=_spec(rank)).state_for_push()
        assert all("lora_A" in k or "lora_B" in k for k in state)
        assert _push_bytes(state) == 4 * rank * per_rank  # float32
    full = _push_bytes(base.model.state_dict())
    assert _push_bytes(_trainer(base, spec=_spec(2)).state_for_push()) < 0.2 * full


def test_the_engine_merges_each_push_and_samples_with_the_trainers_log_probs(base, problems):
    trainer = _trainer(base)
    engine = TorchEngine(base.model, base.eos_id, max_batch=16, max_seq_len=128)
    engine.adapters = AdapterMerge(base.model, trainer.lora)
    for _ in range(2):  # two versions: each merged from the base, not on top of the last one
        trainer.step(_batch(base, problems, engine, seed=trainer.version))
        engine.update_weights(trainer.state_for_push(), trainer.version)
    batch = _batch(base, problems, engine, seed=9)
    mine = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    mask = batch.loss_mask.bool()
    assert (mine[mask] - batch.behaviour_logprobs[mask]).abs().max() < 1e-5
    assert (
        token_logprobs(base.model, batch.input_ids, batch.attention_mask)[mask] - batch.behaviour_logprobs[mask]
    ).abs().max() > 1e-3
    with pytest.raises(KeyError, match="not a LoRA push"):
        engine.update_weights({k: v for k, v in list(trainer.state_for_push().items())[1:]}, 9)


def test_the_checkpoint_is_a_peft_adapter_with_the_same_log_probs_and_resumes(base, problems, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trainer(base)
    batch = _batch(base, problems)
    trainer.step(batch)
    step = save_checkpoint(tmp_path, base, trainer.optimizer, 1, {}, adapted=trainer.model)
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "base"), step
    ).eval()
    ours = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    theirs = token_logprobs(loaded, batch.input_ids, batch.attention_mask)
    assert (ours - theirs).abs().max() < 1e-5
    merged = load_local(step).model  # what `gapless eval --model.path step_1` loads: the adapter merged into the base
    assert (ours - token_logprobs(merged, batch.input_ids, batch.attention_mask)).abs().max() < 1e-5
    assert checkpoint_model_dir(step, True) == tmp_path / "checkpoints" / "base"
    with pytest.raises(ConfigError, match="holds a LoRA adapter"):
        checkpoint_model_dir(step, False)
    fresh = _trainer(base)
    load_checkpoint_adapter(step, fresh.model)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_for_push().values(), trainer.state_for_push().values()))
    with pytest.raises(ConfigError, match="does not fit"):
        load_checkpoint_adapter(step, _trainer(base, spec=_spec(2)).model)


def test_the_kl_reference_is_the_base_with_adapters_disabled(base, problems):
    trainer = _trainer(base, TrainerConfig(lr=1e-2, kl_coef=0.1))
    assert trainer.reference is None  # no copy of the model
    batch = _batch(base, problems)
    trainer.step(batch)
    mb = list(batch.micro_batches(64))[0][1]
    reference = trainer._reference_logprobs(mb)
    assert torch.allclose(reference, token_logprobs(base.model, mb.input_ids, mb.attention_mask), atol=1e-6)
    assert (
        reference - token_logprobs(trainer.model, mb.input_ids, mb.attention_mask)
    ).abs().max() > 1e-4  # adapters on again
    assert trainer.step(batch).kl_mean > 0


def test_bad_lora_settings_are_config_errors_naming_the_field(base):
    with pytest.raises(
        ConfigError, match=r"lora.target_modules: \['qkv'\] match no linear layer.*'down_proj'.*'q_proj'"
    ):
        check_run_targets(LoraConfig(rank=4, target_modules=["q_proj", "qkv"]), base.model)
    with pytest.raises(ConfigError, match="lora.target_modules: 'lm_head' is tied"):
        check_run_targets(LoraConfig(rank=4, target_modules=["lm_head"]), base.model)
    check_run_targets(LoraConfig(rank=0, target_modules=["nothing"]), base.model)  # off: not checked
    with pytest.raises(ConfigError, match="cluster.trainer_world_size = 1"):
        load_config(overrides={"lora.rank": "8", "cluster.trainer_world_size": "2"})
    with pytest.raises(ConfigError, match="lora.target_modules is empty"):
        load_config(overrides={"lora.rank": "8", "lora.target_modules": "[]"})
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(overrides={"lora.rank": "-1"})
    assert run_spec(LoraConfig(), 0) is None and run_spec(LoraConfig(rank=8), 3).scale == 4.0
    assert json.loads(load_config().model_dump_json())["lora"]["rank"] == 0
