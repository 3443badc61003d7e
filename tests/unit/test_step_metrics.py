"""rollout_metrics: closed-form values of the per-step rollout figures."""

from gapless.orchestrate.step_metrics import rollout_metrics
from gapless.types import Completion, Rollout


def rollout(uid: str, text: str, reward: float) -> Rollout:
    return Rollout(
        uid,
        Completion([1], [2, 3], [-0.1, -0.2], [0, 0], "stop", text),
        reward,
        "ok" if reward == 1.0 else "wrong_answer",
    )


def test_distinct_per_group_counts_each_task_and_text_once():
    # group a: 4 completions, 2 distinct texts; group b: 4 completions, all distinct; the same text
    # under another task counts again (the environment runs it against other tests)
    rollouts = [
        rollout("a", "x", 1.0),
        rollout("a", "x", 1.0),
        rollout("a", "y", 0.0),
        rollout("a", "x", 1.0),
        rollout("b", "x", 0.0),
        rollout("b", "y", 0.0),
        rollout("b", "z", 1.0),
        rollout("b", "w", 0.0),
    ]
    m = rollout_metrics(rollouts, zero_variance_groups=0, num_groups=2)
    assert m["rollout/distinct_per_group"] == (2 + 4) / 2
    assert m["rollout/reward_mean"] == 4 / 8 and m["rollout/solved_frac"] == 4 / 8
    assert m["rollout/status_ok"] == 4.0 and m["rollout/status_wrong_answer"] == 4.0


def test_a_collapsed_group_has_one_distinct_completion():
    m = rollout_metrics([rollout("a", "same", 0.0)] * 8, zero_variance_groups=1, num_groups=1)
    assert m["rollout/distinct_per_group"] == 1.0 and m["rollout/zero_variance_frac"] == 1.0
