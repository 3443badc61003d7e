"""Held-out evaluation: greedy pass@1 = fraction of eval tasks whose greedy completion the
environment scores "ok" (for code: passes every hidden test in the sandbox).

Infrastructure failures (`infra_error`: a sandbox or judge outage) are not failures of the model:
they leave the denominator and are counted beside the figure (`EvalScore.infra_errors`, logged
as `eval/infra_errors`). When nothing could be scored, pass@1 is NaN, never 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from gapless.envs.base import Environment, Task
from gapless.generate.protocol import Generator
from gapless.types import Rollout, SamplingParams


def greedy_rollouts(
    sampler: Generator, env: Environment, tasks: Sequence[Task], encode, max_new_tokens: int, batch_size: int = 256
) -> list[Rollout]:
    """One greedy rollout per task, scored, in task order."""
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    rollouts: list[Rollout] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        completions = sampler.generate([encode(t.prompt) for t in chunk], params)
        rollouts += [rollout for (rollout,) in env.score_groups(chunk, [[c] for c in completions])]
    return rollouts


@dataclass(frozen=True)
class EvalScore:
    pass_at_1: float  # ok / scored; NaN when nothing could be scored
    infra_errors: int  # rollouts left out of the denominator
    scored: int

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> "EvalScore":
        scored = [r for r in rollouts if not r.is_infra_failure]
        ok = sum(r.status == "ok" for r in scored)
        return cls(ok / len(scored) if scored else math.nan, len(rollouts) - len(scored), len(scored))


def greedy_pass_at_1(
    sampler: Generator, env: Environment, tasks: Sequence[Task], encode, max_new_tokens: int, batch_size: int = 256
) -> EvalScore:
    return EvalScore.of(greedy_rollouts(sampler, env, tasks, encode, max_new_tokens, batch_size))


def multi_turn_pass_at_1(sampler: Generator, env, tasks: Sequence[Task], encode, max_new_tokens: int) -> EvalScore:
    """Over tasks whose greedy multi-turn episode could be scored: the fraction ending 'ok'."""
    groups = env.rollout_groups(sampler, tasks, 1, SamplingParams(greedy=True, max_new_tokens=max_new_tokens), encode)
    return EvalScore.of([rollout for (rollout,) in groups])
