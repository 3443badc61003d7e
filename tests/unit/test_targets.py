import math

import pytest

from gapless.config import TrainerConfig
from gapless.trainer.targets import overlong_penalty, step_targets
from gapless.types import Completion, Group, Rollout


def rollout(reward: float, length: int = 3, finish: str = "stop", status: str = "wrong_answer") -> Rollout:
    completion = Completion([1], [5] * length, [-1.0] * length, [0] * length, finish, "")
    return Rollout("p", completion, reward, status)


def groups(rollouts: list[Rollout], size: int) -> list[Group]:
    """Consecutive runs of `size` rollouts, as the sources hand them over."""
    return [
        Group(index=i // size, task_index=0, born=0, rollouts=tuple(rollouts[i : i + size]))
        for i in range(0, len(rollouts), size)
    ]


def test_overlong_penalty_is_linear_over_the_buffer():
    # max 8, buffer 4: no penalty up to length 4, then -(length - 4) / 4, reaching -1 at 8
    assert [overlong_penalty(n, 8, 4, 1.0) for n in (1, 4, 5, 6, 8)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(7, 8, 4, 0.5) == -0.375  # -0.5 * 3 / 4


def test_default_targets_are_plain_grpo():
    group = [rollout(1.0), rollout(0.0), rollout(0.0), rollout(1.0)]
    out = step_targets(groups(group, 4), TrainerConfig(), max_new_tokens=8)
    # mean 0.5, sample std sqrt(1/3) = 0.57735, eps 1e-6: 0.5 / 0.577351 = 0.866024
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert out.advantages == pytest.approx([a, -a, -a, a], abs=1e-12)
    assert out.is_trainable == [True] * 4 and out.keep == [0, 1, 2, 3] and out.metrics == {}


def test_soft_overlong_penalty_shapes_rewards_before_the_baseline():
    # max 8, buffer 4: rewards 1 (length 8 -> -1) and 1 (length 3 -> 0) -> shaped 0 and 1
    # Dr. GRPO advantages: mean 0.5 -> -0.5, +0.5
    group = [rollout(1.0, length=8, finish="length"), rollout(1.0, length=3)]
    cfg = TrainerConfig(overlong="penalty", overlong_buffer=4, advantage="drgrpo")
    out = step_targets(groups(group, 2), cfg, max_new_tokens=8)
    assert out.advantages == pytest.approx([-0.5, 0.5])
    assert out.metrics["rollout/shaped_reward_mean"] == pytest.approx(0.5)


def test_masked_truncations_keep_their_reward_in_the_baseline():
    # rewards 0 (truncated), 1, 1: Dr. GRPO mean 2/3 -> -2/3, 1/3, 1/3; the truncated one does not train
    group = [rollout(0.0, length=8, finish="length"), rollout(1.0), rollout(1.0)]
    out = step_targets(groups(group, 3), TrainerConfig(overlong="mask", advantage="drgrpo"), max_new_tokens=8)
    assert out.advantages == pytest.approx([-2 / 3, 1 / 3, 1 / 3])
    assert out.is_trainable == [False, True, True]
    assert out.metrics["rollout/masked_truncated"] == 1.0


def test_kl_folded_into_the_reward():
    # rewards 1, 0 minus 0.1 * KL (2.0, 0.0) -> 0.8, 0.0; Dr. GRPO: mean 0.4 -> 0.4, -0.4
    group = [rollout(1.0), rollout(0.0)]
    out = step_targets(
        groups(group, 2), TrainerConfig(kl_coef=0.1, kl_placement="reward", advantage="drgrpo"), 8, ref_kl=[2.0, 0.0]
    )
    assert out.advantages == pytest.approx([0.4, -0.4])
    assert out.metrics["rollout/kl_ref_mean"] == 1.0


def test_zero_variance_groups_flagged_and_optionally_dropped():
    rollouts = [
        rollout(1.0),
        rollout(1.0),
        rollout(0.0),
        rollout(1.0),
        rollout(0.5),
        rollout(0.0, status="infra_error"),
    ]
    kept = step_targets(groups(rollouts, 2), TrainerConfig(), max_new_tokens=8)
    assert kept.zero_variance_groups == 2  # [1, 1] and [0.5, infra failure]: one valid rollout is no signal
    assert kept.keep == [0, 1, 2, 3, 4, 5] and kept.advantages[:2] == [0.0, 0.0]
    assert kept.is_trainable == [True] * 5 + [False]  # the infra failure never trains
    dropped = step_targets(groups(rollouts, 2), TrainerConfig(drop_zero_variance=True), max_new_tokens=8)
    assert dropped.keep == [2, 3] and dropped.metrics["rollout/dropped_groups"] == 2.0
