"""From scored groups to the step's batch: reward shaping, advantages, masks, dropped groups.

This module is the first half of a GRPO step (scored groups -> advantages -> masked batch,
`step_batch`); the optimizer step on that batch is trainer.py.

For each group of N rollouts of one prompt, in order:
  1. shape the rewards: DAPO's soft overlong penalty (overlong = 'penalty') and the KL to the
     reference when it is folded into the reward (kl_placement = 'reward');
  2. compute the advantages with the configured estimator (advantages.py) over the rollouts that
     were scored -- infrastructure failures are excluded from the statistics;
  3. decide which rollouts train: scored ones, minus truncated completions when overlong = 'mask'
     (their rewards still form the baseline: masking removes their gradient, not their evidence);
  4. drop the group when it has no signal and drop_zero_variance is set.
The trainer never sees rewards, only the advantages and masks decided here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from gapless.config import TrainerConfig
from gapless.trainer.advantages import group_advantages
from gapless.trainer.batch import Batch, build_batch
from gapless.types import Group, Rollout


@dataclass
class StepTargets:
    advantages: list[float]  # one per rollout, in input order
    is_trainable: list[bool]  # scored, and not masked for truncation
    keep: list[int]  # rows that enter the batch (all unless zero-variance groups are dropped)
    zero_variance_groups: int
    metrics: dict[str, float] = field(default_factory=dict)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_new_tokens - buffer, then
    falling linearly to -penalty at max_new_tokens."""
    excess = length - (max_new_tokens - buffer)
    return -penalty * min(max(excess, 0), buffer) / buffer


def shaped_rewards(
    rollouts: list[Rollout], cfg: TrainerConfig, max_new_tokens: int, ref_kl: list[float] | None = None
) -> list[float]:
    rewards = [r.reward for r in rollouts]
    if cfg.overlong == "penalty":
        rewards = [
            x + overlong_penalty(len(r.completion.token_ids), max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            for x, r in zip(rewards, rollouts)
        ]
    if ref_kl is not None:
        rewards = [x - cfg.kl_coef * kl for x, kl in zip(rewards, ref_kl)]
    return rewards


def step_targets(
    groups: Sequence[Group], cfg: TrainerConfig, max_new_tokens: int, ref_kl: list[float] | None = None
) -> StepTargets:
    """Targets for the step's groups; rows in group order, each group's rollouts in order."""
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = shaped_rewards(rollouts, cfg, max_new_tokens, ref_kl)
    advantages, trainable, keep, zero_var, start = [], [], [], 0, 0
    for g in groups:
        group = g.rollouts
        valid = [not r.is_infra_failure for r in group]
        adv = group_advantages(rewards[start : start + len(group)], valid, estimator=cfg.advantage)
        masked = [cfg.overlong == "mask" and r.completion.finish_reason == "length" for r in group]
        advantages += adv.advantages
        trainable += [ok and not m for ok, m in zip(valid, masked)]
        zero_var += adv.is_zero_variance
        if not (cfg.drop_zero_variance and adv.is_zero_variance):
            keep += range(start, start + len(group))
        start += len(group)
    metrics = {}
    if cfg.overlong != "keep" or ref_kl is not None:
        scored = [x for x, r in zip(rewards, rollouts) if not r.is_infra_failure]
        metrics["rollout/shaped_reward_mean"] = sum(scored) / max(len(scored), 1)
    if cfg.overlong == "mask":
        metrics["rollout/masked_truncated"] = float(sum(1 for r in rollouts if r.completion.finish_reason == "length"))
    if ref_kl is not None:
        metrics["rollout/kl_ref_mean"] = sum(ref_kl) / max(len(ref_kl), 1)
    if cfg.drop_zero_variance:
        metrics["rollout/dropped_groups"] = float(zero_var)
    return StepTargets(advantages, trainable, keep, zero_var, metrics)


def step_batch(
    groups: Sequence[Group],
    cfg: TrainerConfig,
    max_new_tokens: int,
    pad_id: int,
    reference_kl: Callable[[Batch], list[float]] | None = None,
) -> tuple[Batch, StepTargets]:
    """The step's scored groups -> its batch: advantages set, rows that must not train masked,
    dropped groups removed. `reference_kl(batch)` gives each rollout's KL to the reference model;
    it is called only when the KL is folded into the reward."""
    rollouts = [r for g in groups for r in g.rollouts]
    valid = [not r.is_infra_failure for r in rollouts]
    group_ids = [i for i, g in enumerate(groups) for _ in g.rollouts]
    batch = build_batch([r.completion for r in rollouts], [0.0] * len(rollouts), valid, pad_id, group_ids)
    ref_kl = None
    if cfg.kl_coef > 0 and cfg.kl_placement == "reward":
        if reference_kl is None:
            raise ValueError("trainer.kl_placement = 'reward' needs the trainer's reference_kl")
        ref_kl = reference_kl(batch)
    targets = step_targets(groups, cfg, max_new_tokens, ref_kl)
    return batch.with_targets(targets.advantages, targets.is_trainable).select(targets.keep), targets
