"""The run's task lists, rebuilt identically in every process from the config (deterministic)."""

from __future__ import annotations

from gapless.config import Config
from gapless.envs.problems import CodeProblem, generate_problems


def load_train_tasks(cfg: Config) -> list[CodeProblem]:
    return generate_problems(cfg.seed, "train", cfg.task.num_train_prompts, cfg.task.levels, cfg.task.num_hidden_tests)


def load_eval_tasks(cfg: Config) -> list[CodeProblem]:
    return generate_problems(cfg.seed, "eval", cfg.task.num_eval_prompts, cfg.task.levels, cfg.task.num_hidden_tests)
