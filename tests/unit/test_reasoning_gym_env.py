"""reasoning-gym adapter: real data sets, their own scorers, statuses by table, hostile output."""

import pytest

from gapless.envs.reasoning_gym import ReasoningGymEnvironment
from gapless.types import Completion

DATASETS = ["basic_arithmetic", "leg_counting", "spell_backward"]


@pytest.fixture(scope="module", params=DATASETS)
def env(request):
    return ReasoningGymEnvironment(request.param, seed=0, num_train=20, num_eval=10)


def _answer(env):
    return str(env.tasks("train")[0].entry["answer"])


@pytest.mark.parametrize("make_text, status, reward", [
    (lambda a: a, "ok", 1.0),
    (lambda a: f" {a}\nsome more text", "ok", 1.0),
    (lambda a: f"I think so. Answer: {a}", "ok", 1.0),
    (lambda a: f"\\boxed{{{a}}}", "ok", 1.0),
    (lambda a: "#%&", "wrong_answer", 0.0),
    (lambda a: "", "no_answer", 0.0),
    (lambda a: "\\boxed{" + a, "no_answer", 0.0),  # unclosed box
    (lambda a: "9" * 10_000, "wrong_answer", 0.0),
    (lambda a: "é中😀\x00", "wrong_answer", 0.0),
    (lambda a: "{" * 5000 + "}}}", "wrong_answer", 0.0),
])
def test_statuses_and_rewards(env, make_text, status, reward):
    task = env.tasks("train")[0]
    assert env.score(task, make_text(_answer(env))) == (reward, status)


def test_splits_are_disjoint_and_groups_keep_order(env):
    train, evalset = env.tasks("train"), env.tasks("eval")
    assert len(train) == 20 and 0 < len(evalset) <= 10
    assert not {t.prompt for t in train} & {t.prompt for t in evalset}
    assert all(t.prompt.endswith("\nAnswer: ") for t in train)
    task = train[1]
    texts = [str(task.entry["answer"]), "nope", str(task.entry["answer"])]
    (group,) = env.score_groups([task], [[Completion([], [], [], [], "stop", t) for t in texts]])
    assert [r.status for r in group] == ["ok", "wrong_answer", "ok"] and group[0].prompt_uid == task.uid


def test_a_crashing_scorer_is_a_status(env, monkeypatch):
    def broken(answer, entry):
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(env.dataset, "score_answer", broken)
    assert env.score(env.tasks("train")[0], "1") == (0.0, "score_error")


def test_partial_credit_is_its_own_status():
    env = ReasoningGymEnvironment("spell_backward", seed=0, num_train=5, num_eval=2)
    task = env.tasks("train")[0]
    reward, status = env.score(task, task.entry["answer"][:-1] + "#")  # the data set credits matching letters
    assert status == "partial" and 0.0 < reward < 1.0
