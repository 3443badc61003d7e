"""The masking watch (orchestrate/masking.py): the binomial tail by hand, the flag rule on
hand-made groups (a prompt masked far above the rest is flagged, a uniform outage is not, a
version that starts masking is), and both actions: 'fail' scores a flagged cell's masked
rollouts as failures, 'stop' raises naming the cell."""

from __future__ import annotations

import json
import math

import pytest

from gapless.errors import InfrastructureError
from gapless.orchestrate.masking import (
    EXCESS_STATUS,
    MIN_MASKED,
    MaskingExcess,
    MaskingWatch,
    binomial_tail,
)
from gapless.types import Completion, Rollout


def _rollout(uid: str, masked: bool, version: int = 0, reward: float = 1.0) -> Rollout:
    completion = Completion([1], [2, 3], [-0.1, -0.1], [version, version], "stop", "x")
    if masked:
        return Rollout(uid, completion, 0.0, "infra_error", {"error": "judge unreachable"})
    return Rollout(uid, completion, reward, "ok")


def _group(uid: str, masked: int, size: int = 4, version: int = 0) -> list[Rollout]:
    return [_rollout(uid, i < masked, version) for i in range(size)]


def test_binomial_tail_by_hand():
    # P[X >= 2], X ~ Bin(3, 0.5) = (3 + 1) / 8
    assert binomial_tail(3, 2, 0.5) == pytest.approx(0.5)
    # P[X >= 4], X ~ Bin(4, 0.1) = 0.1^4
    assert binomial_tail(4, 4, 0.1) == pytest.approx(1e-4)
    # P[X >= 1], X ~ Bin(10, 0.2) = 1 - 0.8^10
    assert binomial_tail(10, 1, 0.2) == pytest.approx(1 - 0.8**10)
    assert binomial_tail(5, 0, 0.3) == 1.0 and binomial_tail(5, 6, 0.3) == 0.0
    assert 0.0 < binomial_tail(4000, 900, 0.2) < 1.0  # large n: log space, no overflow


def test_a_prompt_masked_far_above_the_rest_is_flagged_and_scored_as_failures():
    watch = MaskingWatch(0.1, "fail")
    for step in range(6):  # 24 clean rollouts of other prompts per step
        for uid in ("a", "b", "c", "d", "e", "f"):
            assert watch.observe(uid, _group(uid, 0, version=step)) == _group(uid, 0, version=step)
    # rest of the run: 0 masked of 144 -> p = 1 / 146; 4 of 4 masked: tail (1/146)^4 < 1e-3
    out = watch.observe("bad", _group("bad", 4))
    assert [r.status for r in out] == [EXCESS_STATUS] * 4 and all(r.reward == 0.0 for r in out)
    assert out[0].info["masked_status"] == "infra_error" and out[0].info["error"] == "judge unreachable"
    assert [(f.kind, f.key) for f in watch.flags.values()] == [("prompt", "bad")]
    # from the flag on, each masked rollout of the prompt is a failure; its scored ones are kept
    out = watch.observe("bad", _group("bad", 2))
    assert [r.status for r in out] == [EXCESS_STATUS] * 2 + ["ok"] * 2
    assert watch.observe("a", _group("a", 1))[0].status == "infra_error"  # another prompt stays masked
    metrics = watch.step_metrics()
    assert metrics["rollout/infra_flagged_prompts"] == 1.0 and metrics["rollout/infra_scored"] == 6.0
    assert metrics["rollout/infra_frac_run"] == pytest.approx(7 / 156)
    assert metrics["rollout/infra_prompt_frac_max"] == pytest.approx(6 / 8)  # 'bad': 6 of 8
    assert watch.step_metrics()["rollout/infra_frac"] == 0.0  # a new window


def test_too_few_or_too_common_masked_rollouts_are_not_flagged():
    watch = MaskingWatch(0.1, "stop")
    watch.observe("bad", _group("bad", MIN_MASKED - 1))  # below the minimum count
    assert not watch.flags
    outage = MaskingWatch(0.1, "stop")  # every prompt masked alike: an outage, not a prompt
    for _ in range(5):
        for uid in ("a", "b", "c", "d"):
            outage.observe(uid, _group(uid, 3))
    assert not outage.flags and outage.step_metrics()["rollout/infra_frac"] == 0.75
    tolerant = MaskingWatch(1.0, "stop")  # max_infra_fraction = 1 turns flagging off
    for uid in "abcdefgh":
        tolerant.observe(uid, _group(uid, 0))
    tolerant.observe("bad", _group("bad", 4))
    assert not tolerant.flags


def test_a_version_that_starts_masking_is_flagged_and_stop_names_it(tmp_path):
    watch = MaskingWatch(0.1, "stop")
    for version in range(5):
        for uid in ("a", "b", "c", "d"):
            watch.observe(uid, _group(uid, 0, version=version))
    watch.observe("a", _group("a", 2, version=5))  # 2 masked: below the minimum
    with pytest.raises(MaskingExcess, match=r"version 5: 4 of 8 rollouts masked") as raised:
        watch.observe("b", _group("b", 2, version=5))
    assert isinstance(raised.value, InfrastructureError)  # exit code 3 from the command line
    assert "pipeline.on_infra_excess" in str(raised.value)
    watch.write(tmp_path / "masking.json")
    record = json.loads((tmp_path / "masking.json").read_text())
    assert record["versions"]["5"] == {"rollouts": 8, "masked": 4, "flagged": True}
    assert set(record["prompts"]) == {"a", "b"} and record["flags"][0]["kind"] == "version"
    assert math.isclose(record["flags"][0]["base_rate"], 1 / 82)  # rest: 0 of 80 masked, add-one smoothed
