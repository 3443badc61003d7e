"""The verifiers adapter on a verifiers task built here (no network, no client): real async scoring."""

import pytest

vf = pytest.importorskip("verifiers.v1")

from gapless.envs.verifiers_adapter import VerifiersEnvironment  # noqa: E402
from gapless.types import Completion  # noqa: E402


class Data(vf.TaskData):
    answer: str


class Capital(vf.Task[Data]):
    @vf.reward(weight=0.75)
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.25)
    async def mentions(self, task, trace) -> float:
        return float(task.answer.lower() in trace.last_reply.lower())


class Broken(vf.Task[Data]):
    @vf.reward
    async def crash(self, task, trace) -> float:
        raise ZeroDivisionError("reward bug")


@pytest.fixture(scope="module")
def env():
    train = [Capital(Data(prompt=f"Capital of {c}?", answer=a)) for c, a in [("France", "Paris"), ("Peru", "Lima")]]
    return VerifiersEnvironment(train, eval=[Broken(Data(prompt="Capital of Chad?", answer="N'Djamena"))])


@pytest.mark.parametrize("text, reward, status", [
    ("Paris", 1.0, "ok"),
    ("It is paris.", 0.25, "partial"),
    ("Lyon", 0.0, "wrong_answer"),
    ("", 0.0, "wrong_answer"),
    ("é中😀\x00" * 2000, 0.0, "wrong_answer"),
])
def test_statuses_and_rewards(env, text, reward, status):
    task = env.tasks("train")[0]
    got_reward, got_status, _ = env.score(task, text)
    assert (got_reward, got_status) == (pytest.approx(reward), status)


def test_groups_and_a_crashing_reward(env):
    task = env.tasks("train")[1]
    (group,) = env.score_groups([task], [[Completion([], [], [], [], "stop", t) for t in ["Lima", "Quito"]]])
    assert [r.status for r in group] == ["ok", "wrong_answer"] and group[0].info == {"exact": 1.0, "mentions": 1.0}
    assert env.tasks("train")[0].prompt == "Capital of France?"
    reward, status, info = env.score(env.tasks("eval")[0], "N'Djamena")
    assert (reward, status) == (0.0, "score_error") and "reward bug" in info["error"]
