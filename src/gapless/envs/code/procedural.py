"""The embedded default task as an environment: procedural code problems (envs/code/problems.py)
scored by the sandboxed code environment, with a teacher for the warm start.

The teacher is imperfect on purpose: with probability `overfit_frac` its demonstration is the
solution that only fits the visible examples (`CodeProblem.overfit_solution`), so RL against the
hidden tests has a habit to unlearn (docs/task.md). Tasks are deterministic in the seed.
"""

from __future__ import annotations

import random

from gapless.envs.code.environment import CodeEnvironment
from gapless.envs.code.problems import CodeProblem, generate_problems


class ProceduralCodeEnvironment(CodeEnvironment):
    def __init__(
        self,
        sandbox,
        limits,
        *,
        seed: int,
        levels: list[int],
        num_train: int,
        num_eval: int,
        num_hidden_tests: int,
        overfit_frac: float,
        concurrency: int = 4,
        reward="pass_fraction",
    ):
        splits = {
            "train": generate_problems(seed, "train", num_train, levels, num_hidden_tests),
            "eval": generate_problems(seed, "eval", num_eval, levels, num_hidden_tests),
        }
        super().__init__(sandbox, limits, concurrency, splits=splits, name="procedural_code", reward=reward)
        self.overfit_frac = overfit_frac

    def reference(self, task: CodeProblem) -> str:
        return task.solution

    def demonstration(self, task: CodeProblem, rng: random.Random) -> str:
        return task.overfit_solution if rng.random() < self.overfit_frac else task.solution
