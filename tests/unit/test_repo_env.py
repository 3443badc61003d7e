"""The coding-agent environment in a real sandbox, driven by a scripted generator (model turns
replayed through the real tokenizer): a table of transcripts with their reward, status and an
observation they must show; one hostile tool call per row, each contained; the teacher's
transcripts equal what the environment shows; the generator's reference fixes pass the real
grader and its broken repositories fail it; hidden tests never reach the session or the
candidate's process."""

from __future__ import annotations

import random

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.config import ModelConfig
from gapless.envs.base import MultiTurnEnvironment, Teacher
from gapless.envs.repo.environment import RepoEnvironment
from gapless.envs.repo.tasks import generate_repo_tasks
from gapless.envs.repo.tools import ideal_transcript, solution_text
from gapless.models import build_tiny
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion, SamplingParams

pytestmark = needs_bwrap
# 5 s per call: a loaded 2-core host can take seconds to start python in a sandbox
LIMITS = SandboxLimits(timeout_s=5.0, memory_mb=256, max_processes=16, tmp_size_mb=4)
TASKS = list({t.prompt: t for t in reversed(generate_repo_tasks(0, "train", 48))}.values())[::-1][:24]  # one per prompt


class ScriptedGenerator:
    """Replays scripted model turns: turn k of a prompt is its k-th script entry (then plain text)."""

    def __init__(self, policy, scripts: dict[str, list[str]], version: int = 0):
        self.policy, self.version = policy, version
        self.scripts = {tuple(policy.encode(prompt)): turns for prompt, turns in scripts.items()}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for context in prompts:
            prompt = max((p for p in self.scripts if tuple(context[: len(p)]) == p), key=len)
            turns = self.scripts[prompt]
            turn = context[len(prompt) :].count(self.policy.eos_id)
            text = turns[turn] if turn < len(turns) else "no more commands"
            ids = self.policy.encode(text) + [self.policy.eos_id]
            out.append(Completion(list(context), ids, [-0.5] * len(ids), [self.version] * len(ids), "stop", text))
        return out


@pytest.fixture(scope="module")
def policy():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    return build_tiny(cfg, [t.prompt + solution_text(t) for t in TASKS], seed=0)


@pytest.fixture(scope="module")
def env():
    sandbox = BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE, max_concurrency=8)
    environment = RepoEnvironment(
        sandbox, {"train": TASKS, "eval": TASKS[:2]}, LIMITS, max_turns=5, sessions=8, skip_frac=0.3, typo_frac=0.3
    )
    yield environment
    try:
        assert sandbox.leftovers() == []  # every session's slot was emptied when its episode ended
    finally:
        environment.close()


def _ideal(task) -> list[str]:
    return [text for text, is_model in ideal_transcript(task, 160) if is_model]


def _cmd(body: str) -> str:
    return f"<cmd>{body}</cmd>"


COUNT_SLEEPS = (
    "import os; print(sum(open(f'/proc/{p}/comm').read().strip() == 'sleep' "
    "for p in os.listdir('/proc') if p.isdigit()))"
)


def _cases():
    t = TASKS
    fixed_module = t[2].fixed_files[t[2].path]
    forged_check = "print('ok')\n"
    leak = (
        t[7]
        .fixed_files[t[7].path]
        .replace(t[7].fixed_line, "    return len(open('/work/job/judge/tests.json').read())")
    )
    return [
        # (task, model turns, reward, status, a fragment the transcript must hold)
        (t[0], _ideal(t[0]), 1.0, "ok", "<out>patched</out>"),
        (t[1], [_cmd("done")], 2 / 6, "tests_failed", ""),  # unfixed: only the pass-to-pass tests
        (
            t[2],
            [_cmd(f"write {t[2].path}\n{fixed_module}"), _cmd("test"), _cmd("done")],
            1.0,
            "ok",
            "<out>ok\n[exit 0]",
        ),
        (t[3], ["I would fix it."], 2 / 6, "tests_failed", ""),  # no <cmd>: ended, graded as is
        (
            t[4],
            [_cmd("fix it"), _cmd("cat"), f"<cmd>patch {t[4].path}\nno separator</cmd>", "<cmd>ls"] + _ideal(t[4])[:1],
            2 / 6,
            "tests_failed",
            "unknown command 'fix'",
        ),  # malformed commands are observations
        (t[5], [_cmd("ls"), _cmd("run echo hi; exit 3")], 2 / 6, "tests_failed", "hi\n[exit 3]"),
        # hostile calls, one per row: each contained, the episode goes on
        (
            t[6],
            [_cmd("cat ../../etc/passwd"), _cmd("cat /etc/passwd"), *_ideal(t[6])[1:]],
            1.0,
            "ok",
            "outside the repository: use a relative path",
        ),  # paths refused before anything runs ...
        (t[7], [_cmd(f"write {t[7].path}\n{leak}"), _cmd("done")], 2 / 6, "tests_failed", "wrote"),  # the candidate
        # cannot read the hidden tests while graded (the judge's files are not in its mount namespace)
        (
            t[8],
            [
                _cmd("run ln -s /etc/passwd leak.py; ln -s / up"),
                _cmd("cat leak.py"),
                _cmd("cat up/etc/hostname"),
                _cmd("write leak.py\nx = 1"),
            ],
            2 / 6,
            "tests_failed",
            "leak.py leads outside the repository",
        ),
        (
            t[9],
            [
                _cmd("write big.py\n" + "x" * 5000),
                _cmd("run python -c \"open('f', 'w').write('x' * 10**8)\""),
                *_ideal(t[9]),
            ],
            1.0,
            "ok",
            "refused: the file would be larger than 4096 bytes",
        ),
        (
            t[10],
            [_cmd("run python -c 'import os\nwhile True:\n    os.fork()'"), *_ideal(t[10])],
            1.0,
            "ok",
            "<out>ok\n[exit 0]",
        ),  # a fork bomb meets the process cap and the deadline; its group is killed
        (t[11], [_cmd("run yes"), *_ideal(t[11])], 1.0, "ok", "y\ny\ny"),  # a flood keeps 160 bytes
        (
            t[12],
            [_cmd("run sleep 60 & echo started"), _cmd(f'run python -c "{COUNT_SLEEPS}"'), _cmd("done")],
            2 / 6,
            "tests_failed",
            "<out>0\n",
        ),  # background children die with their call
        (t[13], [*_ideal(t[13])[:2], _cmd(f"write check.py\n{forged_check}"), _cmd("done")], 1.0, "ok", "wrote"),
        (
            t[14],
            [_cmd(f"write check.py\n{forged_check}"), _cmd("test"), _cmd("done")],
            2 / 6,
            "tests_failed",
            "<out>ok\n",
        ),  # editing the visible check changes nothing: the hidden tests grade
        (
            t[15],
            [_cmd("run ls -aR /work /tmp 2>&1 | grep -c json; echo end")],
            2 / 6,
            "tests_failed",
            "<out>0\nend\n",
        ),  # the hidden tests are nowhere in the session
    ]


CASES = _cases()


@pytest.fixture(scope="module")
def played(env, policy):
    scripts = {task.prompt: turns for task, turns, *_ in CASES}
    groups = env.rollout_groups(
        ScriptedGenerator(policy, scripts), [c[0] for c in CASES], 1, SamplingParams(), policy.encode
    )
    return [group[0] for group in groups]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_transcripts(played, index):
    task, turns, reward, status, fragment = CASES[index]
    rollout = played[index]
    assert (rollout.reward, rollout.status) == (pytest.approx(reward), status), rollout.info
    assert fragment in rollout.completion.text, rollout.completion.text
    assert rollout.info["hidden"] == 6 and not rollout.is_infra_failure


def test_the_teachers_transcripts_are_what_the_environment_shows(env, policy):
    """Each kind of demonstration (ideal, skipped reading, wrong operator) replayed through the
    environment gives back exactly the teacher's text: the warm start teaches the real thing."""
    rng, picked = random.Random(0), {}
    for task in TASKS[16:]:  # one task per kind of demonstration
        for _ in range(20):
            turns = env.demonstration_turns(task, rng)
            kind = (turns[0][0].startswith("<cmd>cat"), "FAIL" in "".join(text for text, _ in turns), len(turns))
            if kind not in picked:
                picked[kind] = (task, turns)
                break
    assert len(picked) >= 3, picked.keys()
    tasks = [task for task, _ in picked.values()]
    scripts = {task.prompt: [text for text, is_model in turns if is_model] for task, turns in picked.values()}
    groups = env.rollout_groups(ScriptedGenerator(policy, scripts), tasks, 1, SamplingParams(), policy.encode)
    for (task, turns), (rollout,) in zip(picked.values(), groups):
        assert rollout.completion.text == "".join(text for text, _ in turns)
        assert rollout.completion.loss_mask.count(0) > 0  # the observations are masked
    assert isinstance(env, MultiTurnEnvironment) and isinstance(env, Teacher)


def test_token_accounting_and_the_context_bound(played, env, policy):
    rollout = played[0]
    completion = rollout.completion
    model_tokens = sum(len(policy.encode(text)) + 1 for text in CASES[0][1])
    assert sum(completion.loss_mask) == model_tokens and len(completion.token_ids) == len(completion.loss_mask)
    bound = env.max_context_tokens(len(completion.prompt_ids), max(len(policy.encode(t)) + 1 for t in CASES[0][1]))
    assert len(completion.prompt_ids) + len(completion.token_ids) <= bound


def test_generated_repositories_grade_as_designed(env):
    """Reference fixes pass every hidden test; the broken repositories pass only the others."""
    for task in TASKS[:3]:
        assert env.grade(task, task.fixed_files)[:2] == (1.0, "ok")
        reward, status, info = env.grade(task, task.files)
        assert (status, info["passed"]) == ("tests_failed", 2)
    train, held_out = generate_repo_tasks(0, "train", 200), generate_repo_tasks(0, "eval", 200)
    assert {t.prompt + t.files[t.path] for t in train}.isdisjoint({t.prompt + t.files[t.path] for t in held_out})
    assert [t.files for t in generate_repo_tasks(0, "eval", 5)] == [t.files for t in held_out[:5]]


def test_the_single_turn_path_is_refused_loudly(env):
    with pytest.raises(TypeError, match="multi-turn"):
        env.score_groups(TASKS[:1], [[]])
