"""Group-relative advantages (GRPO).

Each rollout's advantage is its reward's deviation from its group's mean, divided by the group's
standard deviation (sample std, n - 1 in the denominator, plus `eps`). Rollouts whose scoring
failed for infrastructure reasons are excluded from the group statistics and get advantage 0
with `valid = False`, so they neither pull the baseline nor receive gradient: a sandbox that could
not start is never a reward of 0. A group whose valid rewards are all equal carries no signal:
its advantages are exactly 0 (flagged by `is_zero_variance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float]
    valid: list[bool]
    is_zero_variance: bool


def group_advantages(rewards: list[float], valid: list[bool] | None = None, eps: float = 1e-6) -> GroupAdvantages:
    valid = list(valid) if valid is not None else [True] * len(rewards)
    kept = [r for r, ok in zip(rewards, valid) if ok]
    if len(kept) < 2:
        return GroupAdvantages([0.0] * len(rewards), valid, True)
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((r - mean) ** 2 for r in kept) / (len(kept) - 1))
    if std == 0.0:
        return GroupAdvantages([0.0] * len(rewards), valid, True)
    adv = [(r - mean) / (std + eps) if ok else 0.0 for r, ok in zip(rewards, valid)]
    return GroupAdvantages(adv, valid, False)
