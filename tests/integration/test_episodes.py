"""Multi-turn episodes in the process source (orchestrate/episode_runner.py): the tool_use and
repo tasks and an agent program through the gateway (examples/openai_agent.py) at budgets 0, 1 and 2, driven through the RolloutSource protocol as the run loop does.

Checked: budget 0 with the `waves` schedule equals the inline reference loop bit for bit (tokens,
log-probs, versions, rewards, and so the weights); the `turns` schedule samples the same tokens
at budget 0; at budgets 1 and 2 every admitted group ends exactly once in the ledger and every
trained group's staleness (from its oldest token) is within the budget; with KV re-prefilled on
a swap, the log-prob of every model token of an episode that spans several policy versions
equals the HF model's forward under the weights of the version the token carries.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from gapless.config import load_config
from gapless.orchestrate.loop import RunLoop
from gapless.trainer.batch import token_logprobs
from gapless.trainer.targets import step_batch

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

TASKS = {
    "tool_use": {
        "task.name": '"tool_use"',
        "tools.num_train_prompts": "16",
        "tools.num_eval_prompts": "4",
        "tools.sessions": "4",
        "generator.max_new_tokens": "12",
    },
    "repo": {
        "task.name": '"repo"',
        "repo.num_train_prompts": "8",
        "repo.num_eval_prompts": "2",
        "repo.sessions": "4",
        "repo.max_turns": "3",
        "generator.max_new_tokens": "16",
    },
    "agent": {
        "task.name": '"agent"',
        "agent.command": json.dumps(f"{sys.executable} examples/openai_agent.py"),
        "agent.sessions": "4",
        "task.num_train_prompts": "16",
        "task.num_eval_prompts": "2",
        "task.levels": "[1]",
        "generator.max_new_tokens": "8",
    },
}


def _loop(tmp_path: Path, warm_cache: Path, task: str, kind: str, budget: int, name: str, **extra) -> RunLoop:
    overrides = {
        "run_dir": json.dumps(str(tmp_path / name)),
        "warmstart.cache_dir": json.dumps(str(warm_cache)),
        "model.hidden_size": "32", "model.num_layers": "2", "model.intermediate_size": "64", "model.vocab_size": "300",
        "warmstart.steps": "30", "warmstart.batch_size": "8", "warmstart.lr": "1e-2",
        "generator.group_size": "3", "loop.prompts_per_step": "2",
        "loop.eval_every": "100", "loop.checkpoint_every": "100", "trainer.threads": "1", "trainer.lr": "1e-2",
        "pipeline.generator_threads": "1", "pipeline.trainer_threads": "1", "pipeline.max_staleness": str(budget),
        **TASKS[task], **{k: str(v) for k, v in extra.items()},
    }  # fmt: skip
    return RunLoop(load_config(None, overrides), log=lambda *_: None, source=kind)


def _drive(loop: RunLoop, steps: int, budget: int, states: dict | None = None) -> list:
    """Run `steps` steps through the source's protocol; each step's rollouts (and, in `states`,
    the weights of every version published)."""
    cfg, source = loop.cfg, loop.source
    source.start(loop.trainer.state_for_push(), loop.trainer.version)
    if states is not None:
        states[loop.trainer.version] = {k: v.clone() for k, v in loop.trainer.state_for_push().items()}
    taken_all, reason = [], "run_failed"
    try:
        for step in range(steps):
            taken = source.take(step)
            assert len(taken.groups) == cfg.loop.prompts_per_step
            assert all(len(group.rollouts) == cfg.generator.group_size for group in taken.groups)
            assert all(step - r.completion.oldest_version <= budget for r in taken.rollouts)
            batch, _ = step_batch(
                taken.groups, cfg.trainer, loop.max_seq_len(), loop.policy.pad_id, loop.trainer.reference_kl
            )
            loop.trainer.step(batch)
            source.publish(loop.trainer.state_for_push(), loop.trainer.version)
            if states is not None:
                states[loop.trainer.version] = {k: v.clone() for k, v in loop.trainer.state_for_push().items()}
            source.stats()
            taken_all.append(taken.rollouts)
        reason = "run_ended"
    finally:
        source.close(reason, loop.trainer.version)
        loop.sinks.close()
        loop.env.close()
    return taken_all


def _record(steps) -> list:
    return [
        [
            (
                r.completion.token_ids,
                r.completion.logprobs,
                r.completion.versions,
                r.completion.loss_mask,
                r.reward,
                r.status,
            )
            for r in rollouts
        ]
        for rollouts in steps
    ]


def _ledger_checks(run: Path, budget: int, steps: int, groups_per_step: int) -> None:
    events = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]
    admitted = [e["group"] for e in events if e["event"] == "admitted"]
    ended = [e["group"] for e in events if e["event"] in ("trained", "dropped")]
    assert len(admitted) == len(set(admitted)) and Counter(ended) == Counter(admitted)  # exactly once
    trained = [e for e in events if e["event"] == "trained"]
    assert len(trained) == steps * groups_per_step
    assert all(0 <= e["staleness"] <= budget for e in trained)


@pytest.mark.slow
def test_tool_use_budget_zero_waves_equal_the_reference_loop(tmp_path, warm_cache):
    inline = _record(_drive(_loop(tmp_path, warm_cache, "tool_use", "inline", 0, "inline"), 2, 0))
    waves = _record(
        _drive(
            _loop(tmp_path, warm_cache, "tool_use", "process", 0, "waves", **{"pipeline.turn_schedule": '"waves"'}),
            2,
            0,
        )
    )
    assert inline == waves  # tokens, log-probs, versions, masks, rewards: bit for bit
    assert any(sum(1 for m in r[3] if m == 0) for step in inline for r in step)  # some episode called the tool


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tool_use", "repo", "agent"])
def test_budget_zero_turns_sample_the_reference_tokens(tmp_path, warm_cache, task):
    inline = _record(_drive(_loop(tmp_path, warm_cache, task, "inline", 0, "inline"), 2, 0))
    turns = _record(_drive(_loop(tmp_path, warm_cache, task, "process", 0, "turns"), 2, 0))
    assert [[r[0] for r in s] for s in inline] == [[r[0] for r in s] for s in turns]
    for a, b in zip(inline, turns):
        for x, y in zip(a, b):
            assert max(abs(p - q) for p, q in zip(x[1], y[1])) < 1e-4  # the batches differ: float rounding only
    if task == "repo":
        waves = _record(
            _drive(
                _loop(tmp_path, warm_cache, task, "process", 0, "waves", **{"pipeline.turn_schedule": '"waves"'}), 2, 0
            )
        )
        assert waves == inline


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tool_use", "repo", "agent"])
@pytest.mark.parametrize("budget", [1, 2])
def test_budgets_keep_the_ledger_and_the_bound(tmp_path, warm_cache, task, budget):
    steps = 4
    loop = _loop(tmp_path, warm_cache, task, "process", budget, f"b{budget}", **{"pipeline.oversample": "0.5"})
    _drive(loop, steps, budget)
    _ledger_checks(tmp_path / f"b{budget}", budget, steps, loop.cfg.loop.prompts_per_step)


@pytest.mark.slow
def test_tokens_across_a_mid_episode_swap_match_the_forward_of_their_versions(tmp_path, warm_cache):
    states: dict[int, dict] = {}
    loop = _loop(
        tmp_path,
        warm_cache,
        "tool_use",
        "process",
        2,
        "swap",
        **{"tools.latency_s": "0.3", "generator.recompute_kv": "true"},
    )
    steps = _drive(loop, 5, 2, states)
    model = loop.policy.model
    spanning = 0
    for rollouts in steps:
        for r in rollouts:
            c = r.completion
            model_versions = {v for v, m in zip(c.versions, c.loss_mask) if m}
            spanning += len(model_versions) > 1
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            for version in model_versions:
                model.load_state_dict(states[version])
                with torch.no_grad():
                    ref = token_logprobs(model, ids, torch.ones_like(ids), loop.cfg.generator.temperature)[
                        0, len(c.prompt_ids) - 1 :
                    ]
                for t, (v, m, lp) in enumerate(zip(c.versions, c.loss_mask, c.logprobs)):
                    if m and v == version:
                        assert abs(ref[t].item() - lp) < 2e-4, (version, t, ref[t].item(), lp)
    assert spanning > 0  # some episode's turns were sampled by different policy versions


@pytest.mark.slow
def test_suspended_episodes_resume_under_newer_weights_within_the_state_bound(tmp_path, warm_cache):
    bound = 1
    loop = _loop(
        tmp_path,
        warm_cache,
        "tool_use",
        "process",
        2,
        "state",
        **{
            "pipeline.suspend_between_turns": "true",
            "pipeline.resume_after_s": "1.0",
            "pipeline.oversample": "1.0",
            "warmstart.steps": "150",
            "model.hidden_size": "64",
            "model.intermediate_size": "128",  # calls tools
            "pipeline.max_env_state_staleness": str(bound),
            "pipeline.env_state_stale": '"restart"',
        },
    )
    steps = _drive(loop, 5, 2)
    _ledger_checks(tmp_path / "state", 2, 5, loop.cfg.loop.prompts_per_step)
    events = [json.loads(line) for line in (tmp_path / "state" / "groups.jsonl").read_text().splitlines()]
    pairs = [p for e in events if e["event"] == "trained" for p in e.get("env_state", []) if None not in p]
    assert pairs and all(0 <= resumed - wrote <= bound for wrote, resumed in pairs)  # recorded, and within the bound
    resumed = [r for rollouts in steps for r in rollouts if r.info.get("resumes")]
    assert resumed and any(r.info["resumed_by_version"] > r.info["env_state_version"] for r in resumed)  # newer weights
    assert all(r.info["env_state_gap_max"] <= bound for r in resumed)
