"""Group-relative advantages: each rollout's reward against a baseline from its own group.

Estimators (one scalar per rollout, shared by all its tokens):
    grpo    A_i = (r_i - mean) / (std + eps)      Shao et al. 2024 (DeepSeekMath); sample std, n - 1
    drgrpo  A_i = r_i - mean                      Liu et al. 2025 (Dr. GRPO): dividing by the std
                                                  up-weights groups that are nearly all right or wrong
    rloo    A_i = r_i - mean_{j != i} r_j         Ahmadian et al. 2024 (leave-one-out baseline;
                                                  equals n / (n - 1) * (r_i - mean))
Rollouts whose scoring failed for infrastructure reasons are excluded from the group statistics
and get advantage 0 with `valid = False`, so they neither pull the baseline nor receive gradient:
a sandbox that could not start is never a reward of 0. A group whose valid rewards are all equal
(or that has fewer than two valid rollouts) carries no signal: its advantages are exactly 0 and
it is flagged by `is_zero_variance`, for every estimator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

Estimator = Callable[[list[float], float], list[float]]


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float]
    valid: list[bool]
    is_zero_variance: bool


def _grpo(kept: list[float], eps: float) -> list[float]:
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((r - mean) ** 2 for r in kept) / (len(kept) - 1))
    return [(r - mean) / (std + eps) for r in kept]


def _drgrpo(kept: list[float], eps: float) -> list[float]:
    mean = sum(kept) / len(kept)
    return [r - mean for r in kept]


def _rloo(kept: list[float], eps: float) -> list[float]:
    total, others = sum(kept), len(kept) - 1
    return [r - (total - r) / others for r in kept]


ESTIMATORS: dict[str, Estimator] = {"grpo": _grpo, "drgrpo": _drgrpo, "rloo": _rloo}


def group_advantages(
    rewards: list[float], valid: list[bool] | None = None, eps: float = 1e-6, estimator: str = "grpo"
) -> GroupAdvantages:
    valid = list(valid) if valid is not None else [True] * len(rewards)
    kept = [r for r, ok in zip(rewards, valid) if ok]
    if len(kept) < 2 or all(r == kept[0] for r in kept):
        return GroupAdvantages([0.0] * len(rewards), valid, True)
    scores = iter(ESTIMATORS[estimator](kept, eps))
    return GroupAdvantages([next(scores) if ok else 0.0 for ok in valid], valid, False)
