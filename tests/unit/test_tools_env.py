"""The multi-turn tool-use environment in a real sandbox, driven by a scripted generator (a
generator that replays given turns through the real tokenizer): a table of transcripts with
their reward and status, hostile tool code, per-token accounting, and a rollout suspended after
turn 1 and resumed in a new session under a newer policy."""

from __future__ import annotations

import os
import signal

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.envs.base import MultiTurnEnvironment
from gapless.envs.tools.environment import ToolUseEnvironment
from gapless.envs.tools.tasks import ToolTask, generate_tool_tasks
from gapless.sandbox import BwrapSandbox, SandboxLimits, procs
from gapless.types import Completion, SamplingParams

pytestmark = needs_bwrap
TASK = ToolTask("t0", "Q: 37*48+5\n", "37*48+5", "1781")
LIMITS = SandboxLimits(timeout_s=1.5, memory_mb=256, max_processes=16)


class ScriptedGenerator:
    """Replays scripted model turns: turn k of a prompt is its k-th script entry."""

    def __init__(self, policy, scripts: dict[str, list[str]], version: int = 0):
        self.policy, self.version = policy, version
        self.scripts = {tuple(policy.encode(prompt)): turns for prompt, turns in scripts.items()}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for context in prompts:
            prompt = next(p for p in self.scripts if tuple(context[: len(p)]) == p)
            turn = context[len(prompt) :].count(self.policy.eos_id)
            text = self.scripts[prompt][turn]
            ids = self.policy.encode(text) + [self.policy.eos_id]
            out.append(Completion(list(context), ids, [-0.5] * len(ids), [self.version] * len(ids), "stop", text))
        return out


@pytest.fixture(scope="module")
def env():
    sandbox = BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE, max_concurrency=4)
    tasks = {"train": generate_tool_tasks(0, "train", 8), "eval": generate_tool_tasks(0, "eval", 4)}
    environment = ToolUseEnvironment(sandbox, tasks, LIMITS, max_turns=3, sessions=4)
    yield environment
    try:
        assert sandbox.leftovers() == []  # every session's slot was emptied when its episode ended
    finally:
        environment.close()


def play(env, policy, turns: list[str], task: ToolTask = TASK, version: int = 0):
    generator = ScriptedGenerator(policy, {task.prompt: turns}, version)
    (group,) = env.rollout_groups(generator, [task], 1, SamplingParams(), policy.encode)
    return group[0]


CASES = [
    # (model turns, reward, status, a fragment of the transcript)
    (["<py>37*48+5</py>", "Answer: 1781"], 1.0, "ok", "<out>1781</out>"),
    (["Answer: 1781"], 1.0, "ok", "Answer: 1781"),
    (["<py>1+1</py>", "Answer: 2"], 0.0, "wrong_answer", "<out>2</out>"),
    (["<py>x = 6*7</py>", "<py>x</py>", "Answer: 42"], 0.0, "wrong_answer", "<out></out>\n<py>x</py><out>42</out>"),
    (["<py>raise ValueError('boom')</py>", "Answer: 1781"], 1.0, "ok", "<out>ValueError: boom</out>"),
    (["<py>1 +</py>", "Answer: 1781"], 1.0, "ok", "<out>SyntaxError"),
    (["<py>37*48+5"], 0.0, "no_answer", "<py>37*48+5"),  # unclosed tag
    (["I think it is big."], 0.0, "no_answer", "big"),
    ([""], 0.0, "no_answer", ""),
    (["Answer:"], 0.0, "wrong_answer", "Answer:"),
    (["<py>1</py>", "<py>2</py>", "<py>3</py>"], 0.0, "turn_limit", "<out>2</out>"),
    (["<py>while True:\n    pass</py>", "Answer: 1781"], 0.0, "tool_error", "while True"),  # loops forever
    (["<py>print('x' * 10_000_000)</py>", "Answer: 1781"], 0.0, "tool_error", "print"),  # 10 MB of output
    (["<py>import os\nos._exit(0)</py>", "Answer: 1781"], 1.0, "ok", "tool process ended: its variables are lost"),
    (["<py>b = bytearray(2**31)</py>", "Answer: 1781"], 1.0, "ok", "<out>MemoryError"),
    (["<py>print('</out>Answer: 1781')</py>", "Answer: 7"], 0.0, "wrong_answer", "</out>Answer: 1781"),  # tool
    # output that looks like an answer is the environment's text, never the model's answer
]


@pytest.mark.parametrize("turns, reward, status, fragment", CASES, ids=[str(i) for i in range(len(CASES))])
def test_transcripts(env, tiny_policy, turns, reward, status, fragment):
    rollout = play(env, tiny_policy, turns)
    assert (rollout.reward, rollout.status) == (reward, status), rollout.info
    assert fragment in rollout.completion.text
    if status == "tool_error":
        assert rollout.info["tool_status"] in ("timeout", "output_limit")


def test_a_fork_bomb_is_a_tool_status_and_the_environment_goes_on(env, tiny_policy):
    bomb = "<py>import os\nwhile True:\n    os.fork()</py>"
    rollout = play(env, tiny_policy, [bomb, "Answer: 1781"])
    assert rollout.status in ("ok", "tool_error"), rollout.info  # BlockingIOError shown, or killed at the deadline
    assert play(env, tiny_policy, ["<py>37*48+5</py>", "Answer: 1781"]).status == "ok"


def test_token_accounting_masks_the_tool_output(env, tiny_policy):
    rollout = play(env, tiny_policy, ["<py>37*48+5</py>", "Answer: 1781"], version=7)
    c, eos = rollout.completion, tiny_policy.eos_id
    env_ids = tiny_policy.encode("<out>1781</out>\n")
    turn1 = tiny_policy.encode("<py>37*48+5</py>") + [eos]
    turn2 = tiny_policy.encode("Answer: 1781") + [eos]
    assert c.prompt_ids == tiny_policy.encode(TASK.prompt)
    assert c.token_ids == turn1 + env_ids + turn2
    assert c.loss_mask == [1] * len(turn1) + [0] * len(env_ids) + [1] * len(turn2)
    assert c.logprobs == [-0.5] * len(turn1) + [0.0] * len(env_ids) + [-0.5] * len(turn2)
    assert c.versions == [7] * len(c.token_ids) and rollout.info["turns"] == 2 and rollout.info["tool_calls"] == 1


def test_groups_are_in_order_and_episodes_run_in_waves(env, tiny_policy):
    assert isinstance(env, MultiTurnEnvironment)
    tasks = list(env.tasks("train")[:3])
    scripts = {t.prompt: [f"<py>{t.expression}</py>", f"Answer: {t.answer}"] for t in tasks}
    groups = env.rollout_groups(ScriptedGenerator(tiny_policy, scripts), tasks, 3, SamplingParams(), tiny_policy.encode)
    assert [[r.prompt_uid for r in g] for g in groups] == [[t.uid] * 3 for t in tasks]  # 9 episodes, waves of 4
    assert all(r.status == "ok" and r.reward == 1.0 for g in groups for r in g)


def test_a_suspended_rollout_resumes_in_a_new_session_with_its_state(env, tiny_policy):
    turns = [
        "<py>secret = 6*7\nopen('notes.txt', 'w').write('kept')</py>",
        "<py>secret + 1, open('notes.txt').read()</py>",
        "Answer: 1781",
    ]
    episode = env.start(TASK, tiny_policy.encode)
    env.advance(
        ScriptedGenerator(tiny_policy, {TASK.prompt: turns}, version=3),
        [episode],
        SamplingParams(),
        tiny_policy.encode,
        turns=1,
    )
    assert episode.turns == 1 and not episode.is_done and episode.session is not None
    env.suspend(episode)  # snapshot, close the session
    assert episode.session is None and episode.snapshot and episode.state_version == 3
    env.advance(
        ScriptedGenerator(tiny_policy, {TASK.prompt: turns}, version=5), [episode], SamplingParams(), tiny_policy.encode
    )
    rollout = env.to_rollout(episode)
    assert rollout.status == "ok" and "<out>(43, 'kept')</out>" in rollout.completion.text
    assert rollout.info["env_state_version"] == 3 and rollout.info["resumed_by_version"] == 5
    first_turn = len(tiny_policy.encode(turns[0])) + 1
    assert set(rollout.completion.versions[:first_turn]) == {3} and rollout.completion.versions[-1] == 5


def test_score_groups_grades_finished_transcripts(env):
    def c(text):
        return Completion([1], [2], [0.0], [0], "stop", text)

    (group,) = env.score_groups(
        [TASK],
        [
            [
                c("<py>1</py><out>1781</out>\nAnswer: 1781"),
                c("Answer: 1"),
                c("<py>x</py><out>Answer: 1781</out>\n"),
                c("<py>37*48+5</py>"),
            ]
        ],
    )
    assert [(r.reward, r.status) for r in group] == [
        (1.0, "ok"),
        (0.0, "wrong_answer"),
        (0.0, "no_answer"),
        (0.0, "no_answer"),
    ]


def test_teacher_hooks_for_the_warm_start(env):
    import random

    task = env.tasks("train")[0]
    assert env.reference(task) == f"<py>{task.expression}</py><out>{task.answer}</out>\nAnswer: {task.answer}"
    turns = env.demonstration_turns(task, random.Random(0))
    assert turns[-1][1] and turns[-1][0].startswith("Answer:")
    assert set(env.metrics()) >= {"sandbox/runs_total"}


def test_a_snapshot_that_does_not_restore_is_the_models_tool_error(env, tiny_policy):
    turns = [
        "<py>class Trap:\n    def __reduce__(self):\n        return (int, ('x',))\ntrap = Trap()</py>",
        "<py>1</py>",
        "Answer: 1781",
    ]
    episode = env.start(TASK, tiny_policy.encode)
    env.advance(
        ScriptedGenerator(tiny_policy, {TASK.prompt: turns}), [episode], SamplingParams(), tiny_policy.encode, turns=1
    )
    env.suspend(episode)
    env.advance(
        ScriptedGenerator(tiny_policy, {TASK.prompt: turns}, version=1), [episode], SamplingParams(), tiny_policy.encode
    )
    rollout = env.to_rollout(episode)
    assert rollout.status == "tool_error" and rollout.info["tool_status"] == "restore_failed"
    assert "ValueError" in rollout.info["error"] and not rollout.is_infra_failure


def test_after_a_crash_the_model_is_told_exactly_what_survived(env, tiny_policy):
    turns = [
        "<py>x = 1\nopen('f.txt', 'w').write('kept')</py>",
        "<py>import os\nos._exit(0)</py>",
        "<py>'x' in globals(), open('f.txt').read()</py>",
        "Answer: 1781",
    ]
    episode = env.start(TASK, tiny_policy.encode)
    generator = ScriptedGenerator(tiny_policy, {TASK.prompt: turns})
    env.advance(generator, [episode], SamplingParams(), tiny_policy.encode, turns=1)
    env.suspend(episode)  # the variables now live in a snapshot, restored into the next session
    env.max_turns = 4
    try:
        env.advance(generator, [episode], SamplingParams(), tiny_policy.encode)
    finally:
        env.max_turns = 3
    text = env.to_rollout(episode).completion.text
    assert "variables are lost, its files are kept" in text and "<out>(False, 'kept')</out>" in text


def test_a_session_whose_server_dies_after_the_models_code_is_its_tool_error(env, tiny_policy):
    """The host cannot tell a server the model's code got killed from one that died on its own:
    once the model's code has run, the loss is the episode's (scored), never infra_error."""
    turns = ["<py>x = 1</py>", "<py>x</py>", "Answer: 1781"]
    episode = env.start(TASK, tiny_policy.encode)
    env.advance(
        ScriptedGenerator(tiny_policy, {TASK.prompt: turns}), [episode], SamplingParams(), tiny_policy.encode, turns=1
    )
    worker = episode.session._slot.worker
    episode.session.run("import os\nos._exit(0)")  # the next call starts a live process: it needs the server
    for waiter in procs.child_pids(worker._process.pid):
        for server in procs.child_pids(waiter):
            os.kill(server, signal.SIGKILL)
    worker._process.wait()
    env.advance(ScriptedGenerator(tiny_policy, {TASK.prompt: turns}), [episode], SamplingParams(), tiny_policy.encode)
    rollout = env.to_rollout(episode)
    assert (rollout.status, rollout.reward, rollout.info["tool_status"]) == ("tool_error", 0.0, "crashed")
    assert not rollout.is_infra_failure and episode.session is None
