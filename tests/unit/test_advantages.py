import math

import pytest

from gapless.trainer.advantages import group_advantages


def test_group_mean_and_sample_std():
    # rewards 1, 0, 0, 1: mean 0.5; sample std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    # advantage = +-0.5 / 0.57735 = +-0.866025
    out = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert out.advantages == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)
    assert not out.is_zero_variance


def test_partial_rewards():
    # rewards 0.2, 0.4, 0.9: mean 0.5; deviations -0.3, -0.1, 0.4;
    # sample var = (0.09 + 0.01 + 0.16) / 2 = 0.13; std = 0.360555
    out = group_advantages([0.2, 0.4, 0.9], eps=0.0)
    std = math.sqrt(0.13)
    assert out.advantages == pytest.approx([-0.3 / std, -0.1 / std, 0.4 / std], abs=1e-9)


def test_infra_failures_are_excluded_not_scored_zero():
    # third rollout failed to run: statistics over [1, 0] only -> mean 0.5, std sqrt(0.5) = 0.707107
    out = group_advantages([1.0, 0.0, 0.0], valid=[True, True, False], eps=0.0)
    assert out.advantages == pytest.approx([0.707107, -0.707107, 0.0], abs=1e-6)
    assert out.valid == [True, True, False]
    # had it been scored 0, the mean would be 1/3 and the first advantage 1.1547
    assert group_advantages([1.0, 0.0, 0.0], eps=0.0).advantages[0] == pytest.approx(1.154701, abs=1e-6)


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0], [0.4, 0.4, 0.4, 0.4]])
def test_zero_variance_group_has_no_signal(rewards):
    out = group_advantages(rewards)
    assert out.is_zero_variance
    assert out.advantages == [0.0] * len(rewards)


def test_group_with_one_valid_rollout_has_no_signal():
    out = group_advantages([1.0, 0.0], valid=[True, False])
    assert out.is_zero_variance and out.advantages == [0.0, 0.0]


def test_drgrpo_is_mean_centred_without_std():
    # rewards 1, 0, 0, 1: mean 0.5 -> 0.5, -0.5, -0.5, 0.5 (no division by the std 0.57735)
    out = group_advantages([1.0, 0.0, 0.0, 1.0], estimator="drgrpo")
    assert out.advantages == [0.5, -0.5, -0.5, 0.5]
    # rewards 0.2, 0.4, 0.9: mean 0.5 -> -0.3, -0.1, 0.4
    assert group_advantages([0.2, 0.4, 0.9], estimator="drgrpo").advantages == pytest.approx(
        [-0.3, -0.1, 0.4], abs=1e-12
    )


def test_rloo_leave_one_out_baseline():
    # rewards 1, 0, 0: baselines mean(0, 0) = 0, mean(1, 0) = 0.5, mean(1, 0) = 0.5 -> 1, -0.5, -0.5
    # (= 3/2 * (r - 1/3): 3/2 * 2/3 = 1, 3/2 * -1/3 = -0.5)
    out = group_advantages([1.0, 0.0, 0.0], estimator="rloo")
    assert out.advantages == pytest.approx([1.0, -0.5, -0.5], abs=1e-12)
    # rewards 0.2, 0.4, 0.9: baselines 0.65, 0.55, 0.3 -> -0.45, -0.15, 0.6
    assert group_advantages([0.2, 0.4, 0.9], estimator="rloo").advantages == pytest.approx(
        [-0.45, -0.15, 0.6], abs=1e-12
    )


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # valid rewards [1, 0, 1] (the third rollout failed to run and is left out):
        ("grpo", [0.57735, -1.154701, 0.0, 0.57735]),  # mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 2) = 0.57735
        ("drgrpo", [1 / 3, -2 / 3, 0.0, 1 / 3]),  # r - 2/3
        ("rloo", [0.5, -1.0, 0.0, 0.5]),  # 1 - mean(0, 1), 0 - mean(1, 1), 1 - mean(1, 0)
    ],
)
def test_every_estimator_excludes_infra_failures(estimator, expected):
    out = group_advantages([1.0, 0.0, 0.0, 1.0], valid=[True, True, False, True], eps=0.0, estimator=estimator)
    assert out.advantages == pytest.approx(expected, abs=1e-6)
    assert out.valid == [True, True, False, True] and not out.is_zero_variance


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_every_estimator_flags_zero_variance(estimator):
    # the float mean of [0.1] * 3 or [0.4] * 8 differs from the reward in the last bit, yet
    # the group has no signal and must give exactly 0, not a 1e-11 advantage amplified by Adam
    for rewards in ([0.1, 0.1, 0.1], [1.0, 1.0], [0.4] * 8):
        out = group_advantages(rewards, estimator=estimator)
        assert out.is_zero_variance and out.advantages == [0.0] * len(rewards)
