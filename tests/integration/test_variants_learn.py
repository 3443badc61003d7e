"""Every variant raises the reward of a toy task through the real sampler, targets and trainer.

The sandboxed code task needs a long run to separate learning from prompt noise; this toy reward
(the fraction of sampled token ids that are even, about 0.5 for the random tiny policy) is
learnable in a few dozen steps, so a variant whose loss, normaliser or wiring is wrong shows up
as a flat curve. The loop is the synchronous one without the sandbox: sample -> reward ->
targets (groups.py) -> batch -> step -> push.
"""

import copy

import pytest
import torch

from gapless.config import TrainerConfig
from gapless.generate.sampler import TorchSampler
from gapless.trainer.batch import build_batch
from gapless.trainer.targets import step_targets
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import Group, Rollout, SamplingParams

STEPS, GROUP, MAX_NEW_TOKENS = 25, 4, 8

VARIANTS = [dict(loss=name) for name in ("dapo", "grpo", "drgrpo", "gspo", "cispo")] + [
    dict(advantage="rloo"),
    dict(advantage="drgrpo", loss="drgrpo"),
    dict(loss="dapo", clip_eps_high=0.28),
    dict(loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4, epochs=2, old_logprobs="trainer"),
    dict(loss="cispo", clip_eps=0.99, clip_eps_high=4.0, epochs=2),
    dict(old_logprobs="trainer", correction="tis", correction_level="sequence"),
    dict(old_logprobs="trainer", correction="mis"),
    dict(kl_coef=0.05, kl_estimator="k1"),
    dict(kl_coef=0.05, kl_placement="reward"),
    dict(entropy_coef=0.01),
    dict(overlong="penalty", overlong_buffer=4, drop_zero_variance=True),
]  # overlong = "mask" is left out: nearly every toy completion runs to the cap, so nothing would train


def even_token_reward(token_ids: list[int]) -> float:
    return sum(t % 2 == 0 for t in token_ids) / len(token_ids)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_variant_raises_a_toy_reward(tiny_policy, problems, variant):
    model = copy.deepcopy(tiny_policy.model)
    cfg = TrainerConfig(lr=1e-2, **variant)
    trainer = GRPOTrainer(model, cfg, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    sampler = TorchSampler(copy.deepcopy(model), tiny_policy.eos_id, tiny_policy.pad_id)
    prompts = [tiny_policy.encode(p.prompt) for p in problems[:4] for _ in range(GROUP)]
    group_ids = [i // GROUP for i in range(len(prompts))]
    curve = []
    for step in range(STEPS):
        completions = sampler.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, seed=step))
        rollouts = [Rollout("toy", c, even_token_reward(c.token_ids), "ok") for c in completions]
        curve.append(sum(r.reward for r in rollouts) / len(rollouts))
        step_groups = [
            Group(index=i, task_index=i, born=step, rollouts=tuple(rollouts[i * GROUP : (i + 1) * GROUP]))
            for i in range(len(rollouts) // GROUP)
        ]
        targets = step_targets(step_groups, cfg, MAX_NEW_TOKENS)
        batch = build_batch(completions, targets.advantages, targets.is_trainable, tiny_policy.pad_id, group_ids)
        trainer.step(batch.select(targets.keep))
        sampler.update_weights(trainer.state_for_push(), trainer.version)
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last > first + 0.15, f"reward {first:.3f} -> {last:.3f}: {[round(x, 2) for x in curve]}"
    assert torch.isfinite(torch.tensor(curve)).all()
