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
