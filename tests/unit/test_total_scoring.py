"""The scorer is total: any text in a completion (lone surrogates, NUL, huge lines, forged tags)
becomes a Rollout with a status in every environment, never an exception, never infra_error.

Hypothesis drives `score_groups` of the environments that score in-process (math, delayed,
reasoning-gym, judge against a local HTTP judge, verifiers, tool_use's transcript grading) and,
with fewer examples, the ones that run a real sandbox per completion (code's `score_groups`,
tool_use's and repo's `take_turn`), and the agent environment's `take_turn` through a real agent
process and the gateway. The environment's own text goes through an encoder that
refuses what a tokenizer could not encode (a lone surrogate), so the replies it appends are
checked too.

Attack index (model-controlled bytes against the environments: what was tried, where it is held):
    lone surrogate, NUL, huge line, forged tags in a completion   every test here (`texts`)
    ... reaching a tokenizer or a JSON encoder through the agent   test_agent_takes_any_turn,
        gateway (a 500 or a raise out of take_turn)                test_gateway_answers_a_lone_surrogate_and_a_nan_logprob
    a call a chat template refuses (roles that do not alternate)  test_agent_takes_any_turn ("run ")
    a reward that opens a path the completion names (OSError)     test_verifiers_scores_any_text,
                                                                   test_verifiers_adapter.py (..._path_the_completion_names_...)
    a completion that makes a judge endpoint fail (5xx)           test_verifiers_adapter.py (..._breaks_the_judge_...),
                                                                   test_judge_env.py (judge_refused)
    forged, huge or early reply frames from the model's process   test_session_frames.py, test_sandbox_session.py
    the model's code kills its own session or slot                test_sandbox_session.py, test_tools_env.py
    self-inflicted kills, limits, borrowed exit codes             test_sandbox_attribution.py
    candidate exceptions through map/zip/filter/sorted/generators test_judge_control_flow.py
    values the candidate returns (huge ints, deep nesting)        test_code_values.py
Bounded, not closed: a completion that takes a judge server down until the probe is also refused
is infra_error (the step raises if every rollout is); an agent that executes the model's text
outside a sandbox can end other episodes' agents before their first call (envs/agent/environment.py)."""

from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from judge_stub import Reply, completion_reply, serving
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.envs.delayed import DelayedEnvironment
from gapless.envs.episode import Episode
from gapless.envs.math.environment import MathEnvironment
from gapless.envs.math.problems import generate_math_problems
from gapless.types import Completion, Rollout

NASTY = [
    "\ud800",
    "\udfff",
    "\x00",
    "\r\n",
    "\u2028",
    "\ufeff",
    "\U0001f600",
    "x" * 100_000,
    "\\boxed{",
    "}",
    "<py>",
    "</py>",
    "<out>",
    "</out>",
    "Answer: ",
    "<answer>",
    "</answer>",
    "<cmd>",
    "</cmd>",
    "write a.py\n",
    "run ",
    "cat ",
    "\n---\n",
    "</response>",
    "say:",
    "Score: 10",
    "import os\nos._exit(0)",
    "1781",
    "0",
]


def texts(max_pieces: int = 8):
    """Arbitrary text with the pieces a scorer reacts to, lone surrogates and huge lines mixed in."""
    piece = st.one_of(
        st.text(max_size=20), st.sampled_from(NASTY), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    )
    return st.lists(piece, max_size=max_pieces).map("".join)


def completion(text: str) -> Completion:
    return Completion([1], [2, 3], [-0.1, -0.2], [0, 0], "stop", text)


def strict_encode(text: str) -> list[int]:
    """A tokenizer's view: only text that is valid Unicode can be encoded."""
    return list(text.encode("utf-8"))[:64]


def check(rollouts, n: int) -> None:
    assert len(rollouts) == n
    for rollout in rollouts:
        assert isinstance(rollout, Rollout) and isinstance(rollout.status, str)
        assert rollout.status != "infra_error", rollout.info
        assert 0.0 <= rollout.reward <= 1.0


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SANDBOXED = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
MATH_TASK = generate_math_problems(0, "train", 1, [1])[0]


@FAST
@given(batch=st.lists(texts(), min_size=1, max_size=3))
def test_math_and_delayed_score_any_text(batch):
    env = MathEnvironment({"train": [MATH_TASK]}, timeout_s=2)
    check(env.score_groups([MATH_TASK], [[completion(t) for t in batch]])[0], len(batch))
    delayed = DelayedEnvironment(env, 0.0, 1)
    try:
        check(delayed.score_groups([MATH_TASK], [[completion(t) for t in batch]])[0], len(batch))
    finally:
        delayed.close()


def test_math_off_the_main_thread_scores_any_text():
    env = MathEnvironment({"train": [MATH_TASK]}, timeout_s=2)
    batch = [completion(t) for t in ("\ud800\\boxed{\udfff}", "\x00" * 1000, "\\boxed{" * 5000, "1" * 200_000)]
    out: list = []
    worker = threading.Thread(target=lambda: out.append(env.score_groups([MATH_TASK], [batch])[0]))
    worker.start()
    worker.join(120)
    check(out[0], len(batch))


@pytest.fixture(scope="module")
def gym():
    pytest.importorskip("reasoning_gym")
    from gapless.envs.reasoning_gym.environment import ReasoningGymEnvironment

    return ReasoningGymEnvironment("basic_arithmetic", seed=0, num_train=2, num_eval=1)


@FAST
@given(text=texts())
def test_reasoning_gym_scores_any_text(gym, text):
    task = gym.tasks("train")[0]
    check(gym.score_groups([task], [[completion(text), completion(f"<answer>{text}</answer>")]])[0], 2)


@pytest.fixture(scope="module")
def judge():
    """Says 'Score: 5' to every prompt it can read; a 400 to a body it cannot."""
    from gapless.envs.judge.client import HttpJudgeClient
    from gapless.envs.judge.environment import JudgeEnvironment, embedded_judge_tasks

    with serving(lambda body: completion_reply("Score: 5") if body is not None else Reply(400, b"bad body")) as url:
        environment = JudgeEnvironment(
            embedded_judge_tasks(0, 2, 1), HttpJudgeClient(url, timeout_s=5.0, max_retries=0)
        )
        yield environment
        environment.close()


@FAST
@given(batch=st.lists(texts(), min_size=1, max_size=3))
def test_judge_scores_any_text(judge, batch):
    task = judge.tasks("train")[0]
    rollouts = judge.score_groups([task], [[completion(t) for t in batch]])[0]
    check(rollouts, len(batch))
    assert all(r.status == "scored" for r in rollouts)  # every response reached the judge


@pytest.fixture(scope="module")
def verifiers_env():
    vf = pytest.importorskip("verifiers.v1")
    from gapless.envs.verifiers.adapter import VerifiersEnvironment

    class Data(vf.TaskData):
        answer: str

    class Exact(vf.Task[Data]):
        @vf.reward
        async def exact(self, task, trace) -> float:
            return float(trace.last_reply == task.answer)

        @vf.reward(weight=0.0)
        async def names_a_file(self, task, trace) -> float:  # the completion names the path: an OSError is its own
            return float(os.path.isfile(os.stat(trace.last_reply).st_size and trace.last_reply))

    return VerifiersEnvironment([Exact(Data(prompt="2+2?", answer="4"))], eval=[])


@FAST
@given(text=texts())
def test_verifiers_scores_any_text(verifiers_env, text):
    task = verifiers_env.tasks("train")[0]
    check(verifiers_env.score_groups([task], [[completion(text)]])[0], 1)


@FAST
@given(batch=st.lists(texts(), min_size=1, max_size=3))
def test_tool_use_grades_any_transcript(batch):
    from gapless.envs.tools.environment import ToolUseEnvironment
    from gapless.envs.tools.tasks import ToolTask

    task = ToolTask("t0", "Q: 1+1\n", "1+1", "2")
    env = ToolUseEnvironment(sandbox=None, tasks={"train": [task]}, limits=None)
    check(env.score_groups([task], [[completion(t) for t in batch]])[0], len(batch))
    env.pool.shutdown()


# -- the environments that run a real sandbox per completion ------------------------------------


@pytest.fixture(scope="module")
def box():
    from gapless.sandbox import BwrapSandbox, SandboxLimits

    limits = SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=16, tmp_size_mb=4)
    with BwrapSandbox(limits, slot_uid_base=SLOT_UID_BASE, max_concurrency=4) as sandbox:
        yield sandbox, limits
        assert sandbox.leftovers() == []


@needs_bwrap
@SANDBOXED
@given(batch=st.lists(texts(4), min_size=1, max_size=2))
def test_code_scores_any_text(box, problems, batch):
    from gapless.envs.code.environment import CodeEnvironment

    sandbox, limits = box
    env = CodeEnvironment(sandbox, limits, concurrency=2)  # closed with the fixture, not here
    try:
        check(env.score_groups([problems[0]], [[completion(t) for t in batch]])[0], len(batch))
    finally:
        env.pool.shutdown()


@needs_bwrap
@SANDBOXED
@given(turns=st.lists(texts(4).map(lambda t: f"<py>{t}</py>") | texts(4), min_size=1, max_size=3))
def test_tool_use_takes_any_turn(box, turns):
    from gapless.envs.tools.environment import ToolUseEnvironment
    from gapless.envs.tools.tasks import ToolTask

    sandbox, limits = box
    task = ToolTask("t0", "Q: 1+1\n", "1+1", "2")
    env = ToolUseEnvironment(sandbox, {"train": [task]}, limits, max_turns=3, sessions=1)
    episode = env.start_episode(task, [1])
    try:
        for turn in turns:
            if episode.is_done:
                break
            env.take_turn(episode, completion(turn), strict_encode)
        if not episode.is_done:
            env.suspend(episode)
            if not episode.is_done:
                env.take_turn(episode, completion("<py>1</py>"), strict_encode)  # restored in a new session
        check([env.to_rollout(episode)], 1)
    finally:
        env.discard(episode)
        env.pool.shutdown()


@needs_bwrap
@SANDBOXED
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["write a.py\n", "run ", "cat ", "patch a.py\n", "ls", ""]), texts(4)).map(
            lambda vt: f"<cmd>{vt[0]}{vt[1]}</cmd>"
        )
        | texts(4),
        min_size=1,
        max_size=3,
    )
)
def test_repo_takes_any_turn(box, turns):
    from gapless.envs.repo.environment import RepoEnvironment
    from gapless.envs.repo.tasks import generate_repo_tasks

    sandbox, limits = box
    task = generate_repo_tasks(0, "train", 1)[0]
    env = RepoEnvironment(sandbox, {"train": [task]}, limits, max_turns=3, sessions=1)
    episode = Episode(task, [1])
    try:
        for turn in turns:
            if episode.is_done:
                break
            env.take_turn(episode, completion(turn), strict_encode)
        check([env.to_rollout(episode)], 1)
    finally:
        env.discard(episode)
        env.pool.shutdown()


# -- the agent environment: a real agent process, the real gateway ------------------------------
ECHO_AGENT = r"""
import json, os, sys, urllib.error, urllib.request

def post(messages):
    body = json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]})  # ASCII: escapes pass
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:
            sys.exit(3)  # the gateway failed: agent_error, which the test refuses
        return None  # refused (400): the episode's answer is what came before

messages, answer = [("user", os.environ["GAPLESS_PROMPT"])], ""
while True:
    reply = post(messages)
    if reply is None:
        break
    answer = reply
    # a tool whose output is the reply's bytes, read back as a careless tool would: every byte
    # past ASCII becomes a lone surrogate (surrogateescape), so the model's text controls them
    tool = bytes(ord(c) & 0xFF for c in reply).decode("utf-8", "surrogateescape")
    messages += [("assistant", reply), ("user", "tool: " + tool)]
    if "run " in reply:  # a second tool message in a row: a template that wants turns to alternate refuses it
        messages.append(("user", "tool again"))
print(answer.splitlines()[-1] if answer.strip() else "")
"""

ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<|s|>{{ m['role'] }}\n{{ m['content'] }}<|e|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|s|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """An agent environment per prompt format, on a real byte-level tokenizer."""
    import sys

    from gapless.envs.agent.environment import AgentEnvironment
    from gapless.envs.math.environment import ProceduralMathEnvironment
    from gapless.models import train_tokenizer
    from gapless.prompts import PromptEncoder

    script = tmp_path_factory.mktemp("agent") / "echo_agent.py"
    script.write_text(ECHO_AGENT)
    tokenizer = train_tokenizer([MATH_TASK.prompt, "tool: run 123 <|s|> <|e|>"], 300)
    chat = train_tokenizer([MATH_TASK.prompt, "tool: run 123"], 300)
    chat.add_special_tokens({"additional_special_tokens": ["<|s|>", "<|e|>"]})
    chat.chat_template = ALTERNATING
    encoders = {"raw": PromptEncoder(tokenizer, "raw"), "chat": PromptEncoder(chat, "chat")}
    math = ProceduralMathEnvironment({"train": [MATH_TASK], "eval": [MATH_TASK]}, teacher_error_frac=0.0)
    env = AgentEnvironment(
        math,
        [sys.executable, str(script)],
        timeout_s=60.0,
        max_calls=4,
        max_context_tokens=4096,
        max_new_tokens=8,
        sessions=1,
    )
    yield env, encoders
    env.close()
    assert env.live_agents == 0


@FAST
@given(turns=st.lists(texts(6), min_size=1, max_size=4), prompt_format=st.sampled_from(["raw", "chat"]))
def test_agent_takes_any_turn(agents, turns, prompt_format):
    """Whatever the model's text (lone surrogates, NUL, huge lines) and whatever the agent makes of
    it (lone surrogates in its next message, calls a template refuses): the episode ends with a
    scored status; the gateway never answers 500 (the agent would exit 3: agent_error)."""
    env, encoders = agents
    encoder = encoders[prompt_format]
    episode = env.start_episode(MATH_TASK, encoder(MATH_TASK.prompt))
    try:
        env.open_episode(episode, encoder)
        for turn in turns:
            if episode.is_done:
                break
            env.take_turn(episode, completion(turn), encoder)
        rollout = env.to_rollout(episode)
    finally:
        env.discard(episode)
    check([rollout], 1)
    assert rollout.status != "agent_error", rollout.info


def test_gateway_answers_a_lone_surrogate_and_a_nan_logprob():
    """The reply to an agent carries the model's text; no byte of it makes the call a 500."""
    import urllib.request

    from gapless.serve.gateway import Gateway

    gateway = Gateway()
    try:
        channel, base_url = gateway.open()
        out: dict = {}

        def call():
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q\ud800"}]}).encode()
            request = urllib.request.Request(base_url + "/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                out["reply"] = json.loads(response.read())

        caller = threading.Thread(target=call)
        caller.start()
        waiting = channel.next(30)
        assert waiting.messages == [("user", "q?")]  # the agent's lone surrogate: replaced before any tokenizer
        channel.answer(waiting, "a\udfffb", [1, 2], [-0.5, float("nan")], [0, 0], "stop", 1)
        caller.join(30)
        assert out["reply"]["choices"][0]["message"]["content"] == "a?b"
        assert out["reply"]["gapless"]["logprobs"] == [-0.5, None]
    finally:
        gateway.close()
