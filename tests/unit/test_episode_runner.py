"""The pipeline's episode runner (orchestrate/episode_runner.py) on the real tool environment
(bubblewrap sessions), with scripted model turns returned out of order, as a continuous batch
returns them: each group is scored once, in sample order, with the rollouts the reference wave
loop (envs/turns.py run_waves) gives for the same turns; 'waves' sends each wave's turn as one
batch of at most `sessions` episodes, in order; 'turns' sends an episode's next turn as soon as
its own tool returned; a cut group gets no further turn and its sessions are closed; the runner
marks the environment's progress per turn answered and per group graded."""

from __future__ import annotations

import json
import random
import time

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.config import ModelConfig
from gapless.envs.tools.environment import ToolUseEnvironment
from gapless.envs.tools.tasks import ToolTask
from gapless.envs.turns import TurnRequest
from gapless.models import build_tiny
from gapless.orchestrate.episode_runner import EpisodeRunner
from gapless.orchestrate.messages import StartEpisodes, TurnDone
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion, SamplingParams

pytestmark = needs_bwrap
LIMITS = SandboxLimits(
    timeout_s=10.0, memory_mb=256, max_processes=16
)  # no test here times a call out: a busy machine must not either
TASKS = [
    ToolTask("a", "Q: 37*48+5\n", "37*48+5", "1781"),
    ToolTask("b", "Q: 12*13\n", "12*13", "156"),
    ToolTask("c", "Q: 21*22-3\n", "21*22-3", "459"),
]
SCRIPTS = {
    "a": ["<py>37*48+5</py>", "Answer: 1781"],
    "b": ["Answer: 150"],
    "c": ["<py>x = 21*22</py>", "<py>x - 3</py>", "Answer: 459"],
}
N = 2


@pytest.fixture(scope="module")
def policy():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    return build_tiny(cfg, [t.prompt + "".join(SCRIPTS[t.uid]) + "<out></out>" for t in TASKS], seed=0)


@pytest.fixture(scope="module")
def env():
    sandbox = BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE, max_concurrency=4)
    environment = ToolUseEnvironment(sandbox, {"train": TASKS, "eval": TASKS}, LIMITS, max_turns=3, sessions=4)
    yield environment
    try:
        assert sandbox.leftovers() == []  # every session's slot was emptied
    finally:
        environment.close()


class Scripted:
    """Turn k of a task's episode is its k-th script line (through the real tokenizer)."""

    def __init__(self, policy, version: int = 0):
        self.policy, self.version = policy, version
        self.prompts = {tuple(policy.encode(t.prompt)): SCRIPTS[t.uid] for t in TASKS}

    def turn(self, context, request_id: str = "", index: int = 0) -> Completion:
        prompt = next(p for p in self.prompts if tuple(context[: len(p)]) == p)
        text = self.prompts[prompt][list(context[len(prompt) :]).count(self.policy.eos_id)]
        ids = self.policy.encode(text) + [self.policy.eos_id]
        return Completion(
            list(context), ids, [-0.5] * len(ids), [self.version] * len(ids), "stop", text, request_id, index
        )

    def generate(self, prompts, params: SamplingParams) -> list[Completion]:
        return [self.turn(c) for c in prompts]


def _run(env, policy, schedule: str, cut: int | None = None, bump_at_c: int | None = None, **state_options):
    """Drive a runner like the pipeline: turns come back in a random order, one at a time.
    `bump_at_c`: the policy version of every turn sampled after task c's first turn came back."""
    sent: list[tuple[TurnRequest, ...]] = []
    sent_log: list[tuple[TurnRequest, ...]] = []
    scored = []
    runner = EpisodeRunner(
        env,
        TASKS,
        policy.encode,
        N,
        schedule,
        lambda replica, turns: (sent.append(turns), sent_log.append(turns)),
        scored.append,
        **state_options,
    )
    runner.handle(StartEpisodes(0, tuple((g, g, 0) for g in range(len(TASKS)))))
    scripted, rng, pending, deadline = Scripted(policy), random.Random(0), [], time.monotonic() + 60
    while len(scored) < len(TASKS) - (cut is not None) and time.monotonic() < deadline:
        while sent:
            pending += sent.pop(0)
        if pending:
            request = pending.pop(rng.randrange(len(pending)))
            runner.handle(TurnDone(request.group, scripted.turn(request.context, str(request.group), request.sample)))
            if bump_at_c is not None and request.group == 2:
                scripted.version = bump_at_c
            if cut is not None and request.group == cut and cut in runner.groups:
                cut_episodes = runner.groups[cut].episodes
                runner.cancel([cut])
        runner.poll()
        time.sleep(0.002)
    while runner.turning and time.monotonic() < deadline:  # a cut episode's running turn comes back
        runner.poll()
        time.sleep(0.002)
    runner.pool.shutdown(wait=True)  # and its session is discarded
    return scored, runner, sent_log if cut is None else cut_episodes


def _rows(rollouts):
    return [(r.prompt_uid, r.reward, r.status, r.completion.token_ids, r.completion.loss_mask) for r in rollouts]


@pytest.mark.parametrize("schedule", ["turns", "waves"])
def test_runner_scores_every_group_once_as_the_reference_loop(env, policy, schedule):
    reference = env.rollout_groups(Scripted(policy), TASKS, N, SamplingParams(), policy.encode)
    marks: list[str] = []
    scored, runner, sent = _run(env, policy, schedule, progress=marks.append)
    assert sorted(g.index for g in scored) == [0, 1, 2]  # each group once
    # the environment's progress marks (watchdog.py): one per turn whose tool calls were answered, one per group graded
    assert sum(m.startswith("answered a turn's tool calls") for m in marks) == N * sum(map(len, SCRIPTS.values()))
    assert sorted(m for m in marks if m.startswith("graded")) == ["graded group 0", "graded group 1", "graded group 2"]
    for group in scored:
        assert _rows(group.rollouts) == _rows(reference[group.index])
    assert [r.reward for g in sorted(scored, key=lambda g: g.index) for r in g.rollouts] == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
        1.0,
    ]
    assert not runner.groups and not runner.turning
    if schedule == "waves":  # one batch per wave turn, of the wave's unfinished episodes, in order
        assert [tuple((t.group, t.sample, t.turn) for t in b) for b in sent] == [
            ((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)),
            ((0, 0, 1), (0, 1, 1)),  # wave 1: a calls, b answers
            ((2, 0, 0), (2, 1, 0)),
            ((2, 0, 1), (2, 1, 1)),
            ((2, 0, 2), (2, 1, 2)),
        ]  # wave 2: c, three turns
    else:  # an episode's next turn goes out alone, when its own tool returned
        assert all(len(b) == 1 for b in sent if b[0].turn > 0)


def test_waves_send_each_wave_turn_as_one_batch_and_turns_one_episode_each(env, policy):
    for schedule in ("waves", "turns"):
        batches: list[tuple[TurnRequest, ...]] = []
        runner = EpisodeRunner(
            env, TASKS, policy.encode, N, schedule, lambda replica, turns: batches.append(turns), lambda g: None
        )
        runner.handle(StartEpisodes(0, tuple((g, g, 0) for g in range(len(TASKS)))))
        first = [tuple((t.group, t.sample) for t in batch) for batch in batches]
        if schedule == "waves":  # sessions = 4: episodes (0,0) (0,1) (1,0) (1,1), then (2,0) (2,1)
            assert first == [((0, 0), (0, 1), (1, 0), (1, 1))]
        else:  # every group's first turns at once
            assert first == [((0, 0), (0, 1)), ((1, 0), (1, 1)), ((2, 0), (2, 1))]
        runner.cancel([0, 1, 2])
        runner.close()


def test_a_cut_group_gets_no_more_turns_and_its_sessions_close(env, policy):
    scored, runner, cut_episodes = _run(env, policy, "turns", cut=2)  # task c: three turns, cut after one returns
    assert sorted(g.index for g in scored) == [0, 1]
    assert all(e.turns <= 1 for e in cut_episodes)  # no turn after the cut was taken
    assert all(e.session is None for e in cut_episodes)  # sessions closed


def test_suspended_episodes_resume_with_their_state_and_record_its_versions(env, policy):
    scored, _, _ = _run(env, policy, "turns", bump_at_c=1, suspend=True)
    (c,) = [g for g in scored if g.index == 2]
    for r in c.rollouts:  # `x = 21*22`, suspended (session closed), `x - 3` in a new session: the value survived
        assert (r.reward, r.status) == (1.0, "ok") and "<out>459</out>" in r.info["transcript"]
        # every turn 1 is sampled after the bump; a turn 0 before it (the first back) or after (its sibling may be)
        assert r.info["resumes"] == 2 and r.info["resumed_by_version"] == 1  # its turns 1 and 2 each resume it
        assert r.info["env_state_version"] == 1  # the last resume (turn 2) found the state turn 1 wrote
    for r in [*c.rollouts, *(r for g in scored if g.index == 0 for r in g.rollouts)]:
        assert r.info["env_state_gap_max"] in (0, 1)
    assert any(r.info["env_state_gap_max"] == 1 for r in c.rollouts)  # resumed under newer weights


def test_a_resume_past_the_state_bound_restarts_from_the_prompt(env, policy):
    scored, _, _ = _run(env, policy, "turns", bump_at_c=3, suspend=True, max_state_staleness=1, on_stale="restart")
    (c,) = [g for g in scored if g.index == 2]
    restarted = [r for r in c.rollouts if r.info.get("env_state_restarts")]
    assert restarted  # resumed by version 3 a state version 0 wrote: gap 3 > 1
    for r in restarted:
        assert r.info["env_state_restarts"] == 1 and (r.reward, r.status) == (1.0, "ok")
        assert set(r.completion.versions) == {3}  # every kept token is the restart's
        assert r.info["resumed_by_version"] - r.info["env_state_version"] <= 1  # the bound holds for what is trained


def test_a_resume_past_the_state_bound_drops_the_group_with_a_reason(env, policy, tmp_path):
    from gapless.orchestrate.buffer import StalenessBuffer
    from gapless.orchestrate.ledger import GroupLedger

    scored, _, _ = _run(env, policy, "turns", bump_at_c=3, suspend=True, max_state_staleness=1, on_stale="drop")
    (c,) = [g for g in scored if g.index == 2]
    assert "env_state_stale" in [r.status for r in c.rollouts]
    ledger = GroupLedger(tmp_path / "groups.jsonl")
    buffer = StalenessBuffer(2, 0, False, ledger)
    assert buffer.arrived(c) == "env_state_stale"
    ledger.close()
    (event,) = [
        json.loads(line)
        for line in (tmp_path / "groups.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "dropped"
    ]
    assert event["reason"] == "env_state_stale" and [0, 3] in event["env_state"]


def test_tool_latency_has_the_mean_and_the_tail_asked_for():
    from gapless.envs.turns import ToolLatency

    assert ToolLatency(0.2).draw() == 0.2 and ToolLatency(0.0, 1.0).draw() == 0.0
    latency = ToolLatency(0.2, 1.0, seed=3)
    draws = sorted(latency.draw() for _ in range(20_000))
    assert abs(sum(draws) / len(draws) - 0.2) < 0.01  # the mean is the configured latency ...
    assert draws[len(draws) // 2] < 0.15 and draws[int(0.99 * len(draws))] > 0.9  # ... with a heavy tail
