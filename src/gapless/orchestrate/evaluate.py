"""Held-out evaluation: greedy pass@1 = fraction of eval tasks whose greedy completion the
environment scores "ok" (for code: passes every hidden test in the sandbox)."""

from __future__ import annotations

from typing import Sequence

from gapless.envs.base import Environment, Task
from gapless.generate.protocol import Generator
from gapless.types import Rollout, SamplingParams


def greedy_rollouts(sampler: Generator, env: Environment, tasks: Sequence[Task], encode,
                    max_new_tokens: int, batch_size: int = 256) -> list[Rollout]:
    """One greedy rollout per task, scored, in task order."""
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    rollouts: list[Rollout] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        completions = sampler.generate([encode(t.prompt) for t in chunk], params)
        rollouts += [rollout for (rollout,) in env.score_groups(chunk, [[c] for c in completions])]
    return rollouts


def greedy_pass_at_1(sampler: Generator, env: Environment, tasks: Sequence[Task], encode,
                     max_new_tokens: int, batch_size: int = 256) -> float:
    rollouts = greedy_rollouts(sampler, env, tasks, encode, max_new_tokens, batch_size)
    return sum(r.status == "ok" for r in rollouts) / len(tasks)


def multi_turn_pass_at_1(sampler: Generator, env, tasks: Sequence[Task], encode, max_new_tokens: int) -> float:
    """Fraction of tasks whose greedy multi-turn episode ends with status 'ok'."""
    groups = env.rollout_groups(sampler, tasks, 1, SamplingParams(greedy=True, max_new_tokens=max_new_tokens), encode)
    return sum(1 for (rollout,) in groups if rollout.status == "ok") / len(tasks)
