"""Build the starting policy: the embedded tiny model (or a local checkpoint) plus the warm start.

The warm-started policy is cached under `warmstart.cache_dir`, keyed by a hash of everything
that determines it (model, task and warm-start settings, seed), and written atomically, so a
second run with the same settings skips straight to RL and gets bit-identical weights.
The warm start needs demonstrations, so it runs only for environments with a teacher
(`envs.base.Teacher`: the procedural code and math tasks); for the others it is skipped with a
log line and RL starts from the initial weights (a local checkpoint, or the random tiny model,
whose tokenizer is then trained on the prompts alone). The warm start trains the full model
also in a LoRA run (`[lora]` is not in the cache key): the adapters go on the policy it makes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from gapless.config import Config
from gapless.envs.base import Environment, Task, Teacher
from gapless.lora import check_run_targets
from gapless.models import Policy, build_tiny, load_local
from gapless.trainer.warmstart.pairs import warm_start
from gapless.trainer.warmstart.transcripts import warm_start_transcripts


def warmstart_key(cfg: Config, env_name: str | None = None) -> str:
    material = {
        "model": cfg.model.model_dump(mode="json", exclude=_default_new_fields(cfg)),
        "task": cfg.task.model_dump(mode="json"),
        "warmstart": cfg.warmstart.model_dump(mode="json", exclude={"cache_dir"}),
        "seed": cfg.seed,
        "format": 2,  # bump when the same settings build a different policy (tokenizer, task texts)
    }
    if env_name is not None and env_name != cfg.task.name:  # a custom environment object
        material["environment"] = env_name
    if cfg.task.name == "tool_use":  # only here, so the code task's cache keys stay as they were
        material["tools"] = {
            **cfg.tools.model_dump(mode="json", exclude={"latency_s", "latency_sigma"}),
            "teacher": 3,
        }  # latency: not the teacher's  # bump when the teacher or the task's tokens change
    if cfg.task.name == "repo":
        material["repo"] = {**cfg.repo.model_dump(mode="json", exclude={"latency_s", "latency_sigma"}), "teacher": 1}
    if cfg.task.name == "swe":
        material["swe"] = {**cfg.swe.model_dump(mode="json"), "teacher": 2}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def _default_new_fields(cfg: Config) -> set[str]:
    """Prompt-format and precision fields left at their defaults stay out of the key, so caches
    built before they existed are still found."""
    defaults = type(cfg.model).model_fields
    return {
        name
        for name in ("prompt_format", "system_prompt", "dtype", "fp32_lm_head")
        if getattr(cfg.model, name) == defaults[name].default
    }


def prepare_policy(cfg: Config, env: Environment, log=print) -> tuple[Policy, dict]:
    train = list(env.tasks("train")) or list(env.tasks("eval"))  # an eval-only set still trains a tokenizer
    teacher = env if isinstance(env, Teacher) else None
    if cfg.warmstart.steps > 0 and teacher is None:
        log(f"warm start: skipped (environment {env.name!r} has no teacher to write demonstrations)")
    if cfg.warmstart.steps == 0 or teacher is None:
        policy = _initial_policy(cfg, train, teacher)
        check_run_targets(cfg.lora, policy.model)
        return policy, {"warmstart_s": 0.0, "warmstart_cached": False}
    cached = Path(cfg.warmstart.cache_dir) / warmstart_key(cfg, env.name)
    if (cached / "config.json").is_file():
        log(f"warm start: cached at {cached}")
        policy = load_local(cached, precision=cfg.model)
        check_run_targets(cfg.lora, policy.model)
        return policy, {"warmstart_s": 0.0, "warmstart_cached": True}
    policy = _initial_policy(cfg, train, teacher)
    check_run_targets(cfg.lora, policy.model)  # before the warm start, not after it
    started = time.perf_counter()

    def report(step: int, loss: float) -> None:
        if step % 50 == 0 or step == cfg.warmstart.steps - 1:
            log(f"warm start {step + 1:>4}/{cfg.warmstart.steps}  loss {loss:.3f}")

    losses = _warm_start(cfg, policy, env, train, teacher, report)
    elapsed = time.perf_counter() - started
    save_cached(policy, cached)
    return policy, {"warmstart_s": elapsed, "warmstart_cached": False, "warmstart_final_loss": losses[-1]}


def save_cached(policy: Policy, cached: Path) -> None:
    """Write a warm-started policy to its cache directory atomically (a reader never sees half of it)."""
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(tmp)
    shutil.rmtree(cached, ignore_errors=True)
    os.replace(tmp, cached)


def _warm_start(
    cfg: Config, policy: Policy, env: Environment, train: list[Task], teacher: Teacher, report
) -> list[float]:
    demonstration_turns = getattr(env, "demonstration_turns", None)
    if callable(demonstration_turns):  # a multi-turn teacher: transcripts of (text, is_model) turns

        def sample(rng):
            task = rng.choice(train)
            return task.prompt, demonstration_turns(task, rng)

        return warm_start_transcripts(policy, sample, cfg.warmstart, cfg.seed, report)
    return warm_start(policy, train, teacher, cfg.warmstart, cfg.seed, report)


def _initial_policy(cfg: Config, train: list[Task], teacher: Teacher | None) -> Policy:
    if cfg.model.path is not None:
        return load_local(cfg.model.path, cfg.model.prompt_format, cfg.model.system_prompt, cfg.model)
    texts = [t.prompt + (teacher.reference(t) if teacher is not None else "") for t in train]
    markup = getattr(teacher, "markup", ())  # a turn format's tags, kept whole by the tokenizer
    # positions for the longest prompt and completion (RoPE has no learned table: only the config's bound grows)
    return build_tiny(
        cfg.model, texts, cfg.seed, max_positions=max(512, cfg.generator.max_new_tokens + 512), markup=markup
    )
