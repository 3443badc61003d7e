"""Build the starting policy: the embedded tiny model (or a local checkpoint) plus the warm start.

The warm-started policy is cached under `warmstart.cache_dir`, keyed by a hash of everything
that determines it (model, task and warm-start settings, seed), and written atomically, so a
second run with the same settings skips straight to RL and gets bit-identical weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from gapless.config import Config
from gapless.envs.problems import CodeProblem
from gapless.models import Policy, build_tiny, load_local
from gapless.trainer.warmstart import warm_start
from gapless.trainer.warmstart_turns import warm_start_transcripts


def warmstart_key(cfg: Config) -> str:
    material = {
        "model": cfg.model.model_dump(mode="json"),
        "task": cfg.task.model_dump(mode="json"),
        "warmstart": cfg.warmstart.model_dump(mode="json", exclude={"cache_dir"}),
        "seed": cfg.seed,
        "format": 1,
    }
    if cfg.task.name == "tool_use":  # only here, so the code task's cache keys stay as they were
        material["tools"] = {**cfg.tools.model_dump(mode="json"), "teacher": 2}  # bump when the teacher changes
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def prepare_policy(cfg: Config, train: list[CodeProblem], log=print) -> tuple[Policy, dict]:
    if cfg.warmstart.steps == 0:
        return _initial_policy(cfg, train), {"warmstart_s": 0.0, "warmstart_cached": False}
    cached = Path(cfg.warmstart.cache_dir) / warmstart_key(cfg)
    if (cached / "config.json").is_file():
        log(f"warm start: cached at {cached}")
        return load_local(cached), {"warmstart_s": 0.0, "warmstart_cached": True}
    policy = _initial_policy(cfg, train)
    started = time.perf_counter()

    def report(step: int, loss: float) -> None:
        if step % 50 == 0 or step == cfg.warmstart.steps - 1:
            log(f"warm start {step + 1:>4}/{cfg.warmstart.steps}  loss {loss:.3f}")

    losses = _warm_start(cfg, policy, train, report)
    elapsed = time.perf_counter() - started
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(tmp)
    shutil.rmtree(cached, ignore_errors=True)
    os.replace(tmp, cached)
    return policy, {"warmstart_s": elapsed, "warmstart_cached": False, "warmstart_final_loss": losses[-1]}


def _warm_start(cfg: Config, policy: Policy, train: list, report) -> list[float]:
    if cfg.task.name == "tool_use":  # multi-turn transcripts from the task's imperfect teacher
        from gapless.envs.tool_task import demonstration

        def sample(rng):
            task = rng.choice(train)
            return task.prompt, demonstration(task, rng, cfg.tools.skip_frac, cfg.tools.typo_frac)

        return warm_start_transcripts(policy, sample, cfg.warmstart, cfg.seed, report)
    return warm_start(policy, train, cfg.warmstart, cfg.seed, report)


def _initial_policy(cfg: Config, train: list[CodeProblem]) -> Policy:
    if cfg.model.path is not None:
        return load_local(cfg.model.path)
    texts = [p.prompt + p.solution for p in train]
    return build_tiny(cfg.model, texts, cfg.seed)
