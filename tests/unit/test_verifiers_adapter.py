"""The verifiers adapter on verifiers tasks built here (no network, no client): real async scoring, every
reward kind of verifiers 0.4, refusals at build time, scoring inside a running event loop, and agreement
with verifiers' own `Task.score` on generated cases."""

import asyncio
import random

import pytest
from judge_stub import Reply, chat_reply, serving

vf = pytest.importorskip("verifiers.v1")

from gapless.envs.verifiers.adapter import VerifiersEnvironment, VerifiersUnsupported  # noqa: E402
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


class FromMessages(vf.Task[Data]):
    """Reads the message history: the user's question and the assistant's reply as messages."""

    @vf.reward
    async def replied_to_the_question(self, task, trace) -> float:
        roles = [m.role for m in trace.messages]
        return float(
            roles[-2:] == ["user", "assistant"]
            and trace.messages[-1].content.strip() == task.answer
            and "[assistant]" in trace.transcript
            and len(trace.assistant_messages) == 1
        )


class Counter(vf.State):
    visits: int = 0


class WithState(vf.Task[Data, Counter]):
    """Reads (and writes) the task's own State type; a runtime it may use, but does not need."""

    @vf.reward(weight=0.5)
    async def first(self, task, trace, runtime=None) -> float:
        await asyncio.sleep(0)  # a real coroutine that yields to the loop
        trace.state.visits += 1
        return float(isinstance(trace.state, Counter) and trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def keyed(self, task, trace) -> dict[str, float]:
        return {"not_truncated": float(not trace.is_truncated)}

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class NeedsRuntime(vf.Task[Data]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward
    async def tests_pass(self, task, trace, runtime) -> float:
        return 1.0


class Synchronous(vf.Task[Data]):
    @vf.reward
    def exact(self, task, trace) -> float:
        return 1.0


class AsksForState(vf.Task[Data]):
    @vf.reward
    async def exact(self, task, trace, state) -> float:
        return 1.0


class Slow(vf.Task[Data]):
    @vf.reward
    async def forever(self, task, trace) -> float:
        await asyncio.sleep(3600)
        return 1.0


@pytest.fixture(scope="module")
def env():
    train = [Capital(Data(prompt=f"Capital of {c}?", answer=a)) for c, a in [("France", "Paris"), ("Peru", "Lima")]]
    environment = VerifiersEnvironment(train, eval=[Broken(Data(prompt="Capital of Chad?", answer="N'Djamena"))])
    yield environment
    environment.close()


@pytest.mark.parametrize(
    "text, reward, status",
    [
        ("Paris", 1.0, "ok"),
        ("It is paris.", 0.25, "partial"),
        ("Lyon", 0.0, "wrong_answer"),
        ("", 0.0, "wrong_answer"),
        ("é中😀\x00" * 2000, 0.0, "wrong_answer"),
    ],
)
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


def test_rewards_that_read_messages_state_and_finish_reason():
    env = VerifiersEnvironment(
        [
            FromMessages(Data(prompt="2+2?", answer="4", system_prompt="Be brief.")),
            WithState(Data(prompt="3+3?", answer="6")),
        ],
        eval=[],
    )
    try:
        history, stateful = env.tasks("train")
        assert history.prompt == "Be brief.\n\n2+2?"
        assert env.score(history, " 4\n")[:2] == (1.0, "ok")
        assert env.score(history, "5")[:2] == (0.0, "wrong_answer")
        reward, status, info = env.score(stateful, "6")
        assert (reward, status) == (1.0, "ok") and info == {"first": 1.0, "not_truncated": 1.0, "metric/length": 1.0}
        assert env.score(stateful, "6", finish_reason="length")[:2] == (0.5, "partial")  # trace.is_truncated
    finally:
        env.close()


@pytest.mark.parametrize(
    "task_type, message",
    [
        (NeedsRuntime, r"verifiers task NeedsRuntime: reward 'tests_pass' needs a runtime"),
        (Synchronous, r"verifiers task Synchronous: reward 'exact' is not async"),
        (AsksForState, r"verifiers task AsksForState: reward 'exact' asks for 'state'"),
    ],
)
def test_rewards_the_adapter_cannot_run_are_refused_at_build_time(task_type, message):
    with pytest.raises(VerifiersUnsupported, match=message) as err:
        VerifiersEnvironment([task_type(Data(prompt="q", answer="a"))], eval=[])
    assert "\n" not in str(err.value)


def test_two_tasks_with_one_key_are_refused():
    data = Data(prompt="2+2?", answer="4")
    with pytest.raises(VerifiersUnsupported, match=r"verifiers tasks Capital and FromMessages share the key"):
        VerifiersEnvironment([Capital(data), FromMessages(data)], eval=[])


def test_scoring_inside_a_running_event_loop(env):
    async def caller():
        task = env.tasks("train")[0]
        (group,) = env.score_groups([task], [[Completion([], [], [], [], "stop", t) for t in ["Paris", "Rome"]]])
        return [r.status for r in group]

    assert asyncio.run(caller()) == ["ok", "wrong_answer"]


def test_a_reward_past_the_tasks_scoring_timeout_is_a_timeout():
    data = Data(prompt="q", answer="a", timeout=vf.TaskData.model_fields["timeout"].annotation(scoring=0.2))
    env = VerifiersEnvironment([Slow(data)], eval=[])
    try:
        assert env.score(env.tasks("train")[0], "a")[:2] == (0.0, "timeout")
    finally:
        env.close()


def judge_model(body) -> Reply:
    """The model behind a plugged LLM judge: says "yes" when the judge's prompt names 'Paris' twice
    (as the reference answer and in the graded response)."""
    return chat_reply(body["model"], "yes" if body["messages"][-1]["content"].count("Paris") >= 2 else "no")


class Judged(vf.Task[Data]):
    pass


def _judged_env(base_url: str) -> VerifiersEnvironment:
    config = vf.TaskConfig(
        judges=[{"id": "reference", "base_url": base_url, "api_key_var": "GAPLESS_TEST_JUDGE_KEY", "model": "m"}]
    )
    return VerifiersEnvironment([Judged(Data(prompt="Capital of France?", answer="Paris"), config)], eval=[])


def test_a_plugged_llm_judge_scores_through_its_endpoint_and_an_unreachable_one_is_infra_error(monkeypatch):
    monkeypatch.setenv("GAPLESS_TEST_JUDGE_KEY", "unused")
    with serving(judge_model) as url:
        env = _judged_env(url)
        try:
            task = env.tasks("train")[0]
            assert env.score(task, "Paris")[:2] == (1.0, "ok")
            assert env.score(task, "Lyon")[:2] == (0.0, "wrong_answer")
        finally:
            env.close()
    env = _judged_env(url)  # nothing listens there any more
    try:
        reward, status, info = env.score(env.tasks("train")[0], "Paris")
        assert (reward, status) == (0.0, "infra_error") and "APIConnectionError" in info["error"]
    finally:
        env.close()


def _peer_reward(task, text: str, finish_reason: str) -> float:
    """verifiers' own scoring, written out here: a trace whose graph verifiers builds from the
    prompt messages and the reply, then `await task.score(trace)` and its `trace.reward`."""
    from verifiers.v1 import graph
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, ModelCall, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, Response, SystemMessage, UserMessage

    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=AgentConfig()),
    )
    prompt = ([SystemMessage(content=task.data.system_prompt)] if task.data.system_prompt else []) + [
        UserMessage(content=task.data.prompt)
    ]
    node = graph.prepare_turn(trace, prompt).commit(
        Response(id="r", created=0, model="m", message=AssistantMessage(content=text), finish_reason=finish_reason)
    )
    trace.calls.append(ModelCall(node=node, finish_reason=finish_reason))
    try:
        asyncio.run(task.score(trace))
    except Exception:  # noqa: BLE001 -- a failed scoring gives no reward
        return 0.0
    return trace.reward


def test_agreement_with_verifiers_own_scoring():
    """Generated replies (correct, wrong, partial, empty, multi-line, padded, huge, adversarial, cut at
    the length limit) over tasks of every reward kind: gapless's reward equals verifiers' own on >= 99%
    (measured: 100%)."""
    rng = random.Random(21)
    words = ["Paris", "Lima", "4", "6", "N'Djamena", "Quito", "x", "é中😀"]
    tasks = [
        Capital(Data(prompt="Capital of France?", answer="Paris")),
        FromMessages(Data(prompt="2+2?", answer="4", system_prompt="Be brief.")),
        WithState(Data(prompt="3+3?", answer="6")),
        Broken(Data(prompt="q", answer="a")),
    ]
    env = VerifiersEnvironment(tasks, eval=[])
    cases, agree = 0, 0
    try:
        for wrapped in env.tasks("train"):
            answer = wrapped.task.data.answer
            texts = [
                answer,
                f" {answer} ",
                f"{answer}\n",
                f"It is {answer}.",
                answer.lower(),
                answer.upper(),
                "",
                f"{answer}\n{answer}",
                "\n".join(rng.sample(words, 3)),
                "z" * 20_000,
                f"{answer}" * 100,
                "\x00\\}{" * 50,
                *(rng.choice(words) + rng.choice(["", ".", "!", " ", "\n"]) for _ in range(30)),
            ]
            for text in texts:
                for finish_reason in ("stop", "length"):
                    ours = env.score(wrapped, text, finish_reason)[0]
                    cases += 1
                    agree += abs(ours - _peer_reward(wrapped.task, text, finish_reason)) < 1e-9
    finally:
        env.close()
    assert cases >= 320
    assert agree / cases >= 0.99


class NamesAFile(vf.Task[Data]):
    @vf.reward
    async def reads_the_named_file(self, task, trace) -> float:
        with open(trace.last_reply) as handle:  # noqa: ASYNC230 -- the completion names the path
            return float(handle.read(len(task.answer)) == task.answer)


def test_a_reward_that_fails_on_a_path_the_completion_names_is_scored_0():
    """An OSError (no such file, name too long, a directory) comes from what the model wrote: it is
    the completion's score_error, never infra_error."""
    env = VerifiersEnvironment([NamesAFile(Data(prompt="Name a file", answer="x"))], eval=[])
    try:
        task = env.tasks("train")[0]
        for text in ["/no/such/file", "/", "x" * 5000]:
            reward, status, info = env.score(task, text)
            assert (reward, status) == (0.0, "score_error"), info
    finally:
        env.close()


def breaks_on_long_text(body) -> Reply:
    """A judge whose server fails (500) on a response longer than its context, and judges others."""
    if len(body["messages"][-1]["content"]) > 2000:
        return Reply(500, b"")
    return chat_reply(body["model"], "no")


def test_a_completion_that_breaks_the_judge_is_scored_0_while_a_probe_is_judged(monkeypatch):
    """A 5xx from the judge looks like an outage; a plain reply (the probe) is judged, so the failure is the
    completion's (score_error, reward 0), and a policy cannot buy a masked rollout with a long text."""
    monkeypatch.setenv("GAPLESS_TEST_JUDGE_KEY", "unused")
    with serving(breaks_on_long_text) as url:
        env = _judged_env(url)
        try:
            task = env.tasks("train")[0]
            texts = ["Lyon", "Paris " * 1000]
            (group,) = env.score_groups([task], [[Completion([], [], [], [], "stop", t) for t in texts]])
            assert [(r.reward, r.status) for r in group] == [(0.0, "wrong_answer"), (0.0, "score_error")], group
            assert "a plain reply was scored" in group[1].info["error"]
        finally:
            env.close()
