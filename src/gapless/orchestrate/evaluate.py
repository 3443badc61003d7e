"""Held-out evaluation: greedy pass@1 = fraction of eval problems whose greedy completion passes
every hidden test in the sandbox."""

from __future__ import annotations

from gapless.envs.code import CodeEnvironment
from gapless.envs.problems import CodeProblem
from gapless.generate.protocol import Generator
from gapless.types import SamplingParams


def greedy_pass_at_1(sampler: Generator, env: CodeEnvironment, problems: list[CodeProblem], encode,
                     max_new_tokens: int, batch_size: int = 256) -> float:
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    solved = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        completions = sampler.generate([encode(p.prompt) for p in chunk], params)
        groups = env.score_groups(chunk, [[c] for c in completions])
        solved += sum(1 for (rollout,) in groups if rollout.status == "ok")
    return solved / len(problems)


def multi_turn_pass_at_1(sampler: TorchSampler, env, tasks: list, encode, max_new_tokens: int) -> float:
    """Fraction of tasks whose greedy multi-turn episode ends with status 'ok'."""
    groups = env.rollout_groups(sampler, tasks, 1, SamplingParams(greedy=True, max_new_tokens=max_new_tokens), encode)
    return sum(1 for (rollout,) in groups if rollout.status == "ok") / len(tasks)
