"""The synchronous reference loop: sample prompts -> generate N each -> score -> train -> push.

Who waits for whom (one process, strictly in turn):

    generator.generate ──> env.score (sandbox threads) ──> trainer.step ──> generator.update_weights
          ^                                                                         │
          └─────────────────────────────── next step ───────────────────────────────┘

A multi-turn environment (envs/base.py MultiTurnEnvironment, e.g. task.name = 'tool_use') drives
generation itself: `env.rollout_groups` replaces generate + score, and its completions' loss
masks keep the environment's tokens out of the loss.

Every rollout of a step is sampled by the current policy version (staleness 0, asserted), so
the behaviour log-probs recorded by the generator are the trainer's old log-probs. `make_batch`
turns the scored groups into the step's batch (reward shaping, advantages, masks and dropped
groups as configured; trainer/groups.py), so the trainer sees advantages, never rewards. Held-out
greedy pass@1 runs at the start, every `loop.eval_every` steps and at the end; checkpoints every
`loop.checkpoint_every` steps and at the end. `resume=True` continues from the last checkpoint.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch

from gapless.config import Config
from gapless.envs.base import MultiTurnEnvironment
from gapless.envs.code import CodeEnvironment
from gapless.envs.problems import CodeProblem, generate_problems
from gapless.generate.sampler import TorchSampler
from gapless.metrics import JsonlSink, ProgressLine, Sinks
from gapless.models import Policy, load_local
from gapless.orchestrate.evaluate import greedy_pass_at_1, multi_turn_pass_at_1
from gapless.orchestrate.policy_setup import prepare_policy
from gapless.sandbox import SandboxLimits, open_sandbox
from gapless.trainer.batch import Batch, build_batch
from gapless.trainer.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from gapless.trainer.groups import StepTargets, step_targets
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import Rollout, SamplingParams


def make_environment(cfg: Config) -> CodeEnvironment:
    if cfg.task.name == "tool_use":
        from gapless.envs.tools import make_tool_environment

        return make_tool_environment(cfg)
    limits = SandboxLimits(timeout_s=cfg.sandbox.timeout_s, memory_mb=cfg.sandbox.memory_mb, max_processes=cfg.sandbox.max_processes)
    sandbox = open_sandbox(limits, cfg.sandbox.python, mode=cfg.sandbox.mode, warm=cfg.sandbox.warm,
                           max_concurrency=cfg.sandbox.concurrency)
    return CodeEnvironment(sandbox, limits, concurrency=cfg.sandbox.concurrency)


def rollout_metrics(rollouts: list[Rollout], zero_variance_groups: int, num_groups: int) -> dict[str, float]:
    rewards = [r.reward for r in rollouts if not r.is_infra_failure]
    lengths = [len(r.completion.token_ids) for r in rollouts]
    metrics = {
        "rollout/reward_mean": sum(rewards) / max(len(rewards), 1),
        "rollout/solved_frac": sum(r.status == "ok" for r in rollouts) / len(rollouts),
        "rollout/completion_len_mean": sum(lengths) / len(lengths),
        "rollout/truncated_frac": sum(r.completion.finish_reason == "length" for r in rollouts) / len(rollouts),
        "rollout/zero_variance_frac": zero_variance_groups / num_groups,
        "sandbox/infra_errors": float(sum(r.is_infra_failure for r in rollouts)),
    }
    for status in sorted({r.status for r in rollouts}):
        metrics[f"rollout/status_{status}"] = float(sum(r.status == status for r in rollouts))
    return metrics


class SyncLoop:
    def __init__(self, cfg: Config, resume: bool = False, log=print):
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        levels = cfg.task.levels
        self.env = make_environment(cfg)
        self.is_multi_turn = isinstance(self.env, MultiTurnEnvironment)
        if self.is_multi_turn:
            self.train, self.eval = list(self.env.tasks("train")), list(self.env.tasks("eval"))
        else:
            self.train = generate_problems(cfg.seed, "train", cfg.task.num_train_prompts, levels, cfg.task.num_hidden_tests)
            self.eval = generate_problems(cfg.seed, "eval", cfg.task.num_eval_prompts, levels, cfg.task.num_hidden_tests)
        self.policy, self.setup_info = prepare_policy(cfg, self.train, log)
        self.start_step, self.state = 0, {}
        checkpoint = latest_checkpoint(self.run_dir) if resume else None
        if checkpoint is not None:
            self.policy = load_local(checkpoint)
        self.trainer = GRPOTrainer(self.policy.model, cfg.trainer, cfg.generator.temperature, cfg.generator.max_new_tokens)
        if checkpoint is not None:
            self.state = load_trainer_state(checkpoint, self.trainer.optimizer)
            self.start_step = self.trainer.version = self.state["step"]
            log(f"resumed from {checkpoint} at step {self.start_step}")
        self.sampler = TorchSampler(copy.deepcopy(self.policy.model), self.policy.eos_id, self.policy.pad_id, self.policy.decode)
        self.sampler.version = self.trainer.version
        self.sinks = Sinks([JsonlSink(self.run_dir / "metrics.jsonl", append=checkpoint is not None), ProgressLine(cfg.loop.steps)])

    def evaluate(self) -> float:
        if self.is_multi_turn:
            return multi_turn_pass_at_1(self.sampler, self.env, self.eval, self.policy.encode, self.cfg.generator.max_new_tokens)
        return greedy_pass_at_1(self.sampler, self.env, self.eval, self.policy.encode, self.cfg.generator.max_new_tokens)

    def sample_prompts(self, step: int) -> list[CodeProblem]:
        rng = random.Random(f"{self.cfg.seed}-prompts-{step}")
        return rng.sample(self.train, self.cfg.loop.prompts_per_step)

    def run(self) -> dict:
        cfg, started = self.cfg, time.perf_counter()
        pass_start = self.state.get("pass@1_start")
        if pass_start is None:
            pass_start = self.evaluate()
            self.sinks.log(self.start_step, {"eval/pass@1": pass_start})
        pass_now, trained_samples = pass_start, self.state.get("trained_samples", 0)
        for step in range(self.start_step, cfg.loop.steps):
            metrics = self.train_step(step)
            trained_samples += cfg.loop.prompts_per_step * cfg.generator.group_size
            done = step + 1
            if done % cfg.loop.eval_every == 0 or done == cfg.loop.steps:
                pass_now = metrics["eval/pass@1"] = self.evaluate()
            self.sinks.log(done, metrics)
            if done % cfg.loop.checkpoint_every == 0 or done == cfg.loop.steps:
                self.checkpoint(done, pass_start, trained_samples)
        summary = {
            "eval/pass@1_start": pass_start,
            "eval/pass@1_end": pass_now,
            "wall_s": time.perf_counter() - started + self.setup_info.get("warmstart_s", 0.0),
            "rl_wall_s": time.perf_counter() - started,
            "trained_samples": trained_samples,
            "steps": cfg.loop.steps,
            **self.setup_info,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.sinks.close()
        self.env.close()
        return summary

    def train_step(self, step: int) -> dict[str, float]:
        cfg, t0 = self.cfg, time.perf_counter()
        problems = self.sample_prompts(step)
        n = cfg.generator.group_size
        params = SamplingParams(cfg.generator.temperature, cfg.generator.top_p, cfg.generator.max_new_tokens, seed=cfg.seed * 1_000_003 + step)
        if self.is_multi_turn:  # generation and scoring interleave, turn by turn
            groups = self.env.rollout_groups(self.sampler, problems, n, params, self.policy.encode)
            completions = [r.completion for group in groups for r in group]
            t1 = time.perf_counter()
        else:
            prompt_ids = [self.policy.encode(p.prompt) for p in problems for _ in range(n)]
            completions = self.sampler.generate(prompt_ids, params)
            t1 = time.perf_counter()
            groups = self.env.score_groups(problems, [completions[g * n : (g + 1) * n] for g in range(len(problems))])
        rollouts = [rollout for group in groups for rollout in group]
        infra_errors = self.env.check_infra(rollouts)
        t2 = time.perf_counter()
        staleness = self.trainer.version - min(r.completion.oldest_version for r in rollouts)
        assert staleness == 0, f"synchronous loop trained on stale rollouts (staleness {staleness})"
        batch, targets = self.make_batch(rollouts)
        stats = self.trainer.step(batch)
        t3 = time.perf_counter()
        self.sampler.update_weights(self.trainer.state_for_push(), self.trainer.version)
        t4 = time.perf_counter()
        gen_tokens = sum(len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask) for c in completions)
        return {
            **rollout_metrics(rollouts, targets.zero_variance_groups, len(problems)),
            **targets.metrics,
            **self.env.sandbox.metrics(),  # cumulative counters and recent latency percentiles
            "sandbox/infra_errors": float(infra_errors),
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/clip_frac": stats.clip_frac,
            "train/ratio_mean": stats.ratio_mean,
            "train/kl_ref": stats.kl_mean,
            "train/entropy": stats.entropy_mean,
            **stats.offpolicy,
            "train/tokens": float(stats.num_tokens),
            "staleness/max": float(staleness),
            "perf/generate_s": t1 - t0,
            "perf/score_s": t2 - t1,
            "perf/train_s": t3 - t2,
            "perf/weight_push_s": t4 - t3,
            "perf/step_s": t4 - t0,
            "perf/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            "perf/trainer_idle_frac": 1.0 - (t3 - t2) / max(t4 - t0, 1e-9),
        }

    def make_batch(self, rollouts: list[Rollout]) -> tuple[Batch, StepTargets]:
        """Scored rollouts (group after group) -> the step's batch: advantages, masks, drops."""
        cfg, n = self.cfg, self.cfg.generator.group_size
        valid = [not r.is_infra_failure for r in rollouts]
        group_ids = [i // n for i in range(len(rollouts))]
        batch = build_batch([r.completion for r in rollouts], [0.0] * len(rollouts), valid, self.policy.pad_id, group_ids)
        ref_kl = None
        if cfg.trainer.kl_coef > 0 and cfg.trainer.kl_placement == "reward":
            ref_kl = self.trainer.reference_kl(batch)
        targets = step_targets(rollouts, n, cfg.trainer, cfg.generator.max_new_tokens, ref_kl)
        return batch.with_targets(targets.advantages, targets.is_trainable).select(targets.keep), targets

    def checkpoint(self, step: int, pass_start: float, trained_samples: int) -> None:
        save_checkpoint(self.run_dir, self.policy, self.trainer.optimizer, step,
                        {"pass@1_start": pass_start, "trained_samples": trained_samples})


def train(cfg: Config, resume: bool = False, log=print) -> dict:
    return SyncLoop(cfg, resume, log).run()
