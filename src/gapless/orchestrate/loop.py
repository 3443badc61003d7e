"""The synchronous reference loop: sample prompts -> generate N each -> score -> train -> push.

Who waits for whom (one process, strictly in turn):

    generator.generate ──> env.score_groups ──> trainer.step ──> generator.update_weights
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

Observability: each step logs `perf/trainer_idle_frac` and `perf/generator_idle_frac` (share of
the step's wall time the actor was not doing its own work), `staleness/*` (0 here) and sandbox
latency; the three actors write `generate`/`eval`, `score` and `train`/`weight_push` spans to the
run's timeline (timeline.py), whose gaps are the waits.

The loop knows environments only through their protocol (envs/base.py): `tasks(split)` and
`score_groups`; `make_environment` (envs/registry.py) picks the one `task.name` names.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import torch

from gapless.config import Config, ConfigError
from gapless.envs.base import Environment, MultiTurnEnvironment, Task, check_infra
from gapless.envs.registry import make_environment
from gapless.errors import RunStopped
from gapless.generate import make_generator
from gapless.generate.groups import generate_groups
from gapless.metrics import open_sinks
from gapless.models import Policy, load_local
from gapless.orchestrate.admission import sample_step_tasks, sampling_params
from gapless.orchestrate.evaluate import EvalScore, greedy_pass_at_1, multi_turn_pass_at_1
from gapless.orchestrate.policy_setup import prepare_policy
from gapless.timeline import export_chrome_trace, open_timeline
from gapless.trainer.batch import Batch, build_batch
from gapless.trainer.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from gapless.trainer.groups import StepTargets, step_targets
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import Rollout


ACTORS = ("generator", "env", "trainer")  # timeline rows; in this loop all three share one process


def env_metrics(env: Environment) -> dict[str, float]:
    """An environment's own counters (the sandbox's: cumulative counts and recent latency
    percentiles), for those that keep any."""
    metrics = getattr(env, "metrics", None)
    return metrics() if callable(metrics) else {}


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
    run_s = [r.info["wall_s"] for r in rollouts if "wall_s" in r.info]
    if run_s:  # wall time of each rollout's sandbox run, as the environment recorded it
        metrics["sandbox/run_s_mean"] = sum(run_s) / len(run_s)
        metrics["sandbox/run_s_max"] = max(run_s)
    for status in sorted({r.status for r in rollouts}):
        metrics[f"rollout/status_{status}"] = float(sum(r.status == status for r in rollouts))
    return metrics


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """`staleness/mean`, `staleness/max` and `staleness/count_<k>` (rollouts consumed at staleness k)."""
    metrics = {"staleness/mean": sum(staleness) / len(staleness), "staleness/max": float(max(staleness))}
    for k in sorted(set(staleness)):
        metrics[f"staleness/count_{k}"] = float(staleness.count(k))
    return metrics


class SyncLoop:
    def __init__(self, cfg: Config, resume: bool = False, log=print, env: Environment | None = None):
        """`env`: an environment object to train on instead of the one `task.name` names (a
        custom environment, examples/reverse_env.py); the loop closes it at the end."""
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        self.env: Environment = env if env is not None else make_environment(cfg)
        self.is_multi_turn = isinstance(self.env, MultiTurnEnvironment)  # drives generation itself
        self.train, self.eval = list(self.env.tasks("train")), list(self.env.tasks("eval"))
        if len(self.train) < cfg.loop.prompts_per_step and cfg.loop.steps > 0:
            self.env.close()
            raise ConfigError(f"task {self.env.name!r} has {len(self.train)} train tasks, fewer than loop.prompts_per_step "
                             f"({cfg.loop.prompts_per_step}); an eval-only set (humaneval) is for `gapless eval`")
        self.policy, self.setup_info = prepare_policy(cfg, self.env, log)
        self.start_step, self.state = 0, {}
        checkpoint = latest_checkpoint(self.run_dir) if resume else None
        if checkpoint is not None:
            self.policy = load_local(checkpoint)
        self.trainer = GRPOTrainer(self.policy.model, cfg.trainer, cfg.generator.temperature, cfg.generator.max_new_tokens)
        if checkpoint is not None:
            self.state = load_trainer_state(checkpoint, self.trainer.optimizer)
            self.start_step = self.trainer.version = self.state["step"]
            log(f"resumed from {checkpoint} at step {self.start_step}")
        self.sampler = make_generator(cfg.generator, self.policy, self.max_seq_len(), self.run_dir)
        self.sampler.version = self.trainer.version
        self.sinks = open_sinks(cfg, cfg.loop.steps, append=checkpoint is not None)
        self.stop_requested: str | None = None  # set by a signal handler (train()): the signal's name
        self.timelines = {actor: open_timeline(self.run_dir, actor, cfg.metrics.timeline) for actor in ACTORS}

    def max_seq_len(self) -> int:
        """Longest context the generator must hold: the longest prompt plus the completion cap."""
        longest = max(len(self.policy.encode(p.prompt)) for p in self.train + self.eval)
        if self.is_multi_turn:  # every turn and every tool output stays in the context
            return self.env.max_context_tokens(longest, self.cfg.generator.max_new_tokens)
        return longest + self.cfg.generator.max_new_tokens

    def evaluate(self) -> EvalScore:
        with self.timelines["generator"].span("eval", version=self.trainer.version):
            if self.is_multi_turn:
                return multi_turn_pass_at_1(self.sampler, self.env, self.eval, self.policy.encode,
                                            self.cfg.generator.max_new_tokens)
            return greedy_pass_at_1(self.sampler, self.env, self.eval, self.policy.encode, self.cfg.generator.max_new_tokens)

    def sample_prompts(self, step: int) -> list[Task]:
        picks = sample_step_tasks(self.cfg.seed, step, len(self.train), self.cfg.loop.prompts_per_step)
        return [self.train[i] for i in picks]

    def run(self) -> dict:
        try:
            return self._run()
        finally:  # also on error or Ctrl-C: the live view restores the terminal, files are flushed
            self.sinks.close()
            for timeline in self.timelines.values():
                timeline.close()

    def _run(self) -> dict:
        cfg, started = self.cfg, time.perf_counter()
        pass_start = self.state.get("pass@1_start")
        if pass_start is None:
            score = self.evaluate()
            pass_start = score.pass_at_1
            self.sinks.log(self.start_step, {"eval/pass@1": pass_start, "eval/infra_errors": float(score.infra_errors)})
        pass_now, trained_samples = pass_start, self.state.get("trained_samples", 0)
        for step in range(self.start_step, cfg.loop.steps):
            try:
                if self.stop_requested:
                    raise RunStopped(self.stop_requested)
                metrics = self.train_step(step)
            except RunStopped:
                if step > self.start_step:  # the steps done since the last checkpoint are kept
                    self.checkpoint(step, pass_start, trained_samples)
                raise
            trained_samples += cfg.loop.prompts_per_step * cfg.generator.group_size
            done = step + 1
            if done % cfg.loop.eval_every == 0 or done == cfg.loop.steps:
                score = self.evaluate()
                pass_now = metrics["eval/pass@1"] = score.pass_at_1  # infra errors left out, counted beside
                metrics["eval/infra_errors"] = float(score.infra_errors)
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
        if cfg.metrics.timeline:
            export_chrome_trace(self.run_dir)
        self.env.close()
        return summary

    def train_step(self, step: int) -> dict[str, float]:
        cfg, t0 = self.cfg, time.perf_counter()
        problems = self.sample_prompts(step)
        n = cfg.generator.group_size
        first = step * len(problems)  # group indices as the pipeline numbers them
        params = [sampling_params(cfg, first + g) for g in range(len(problems))]
        timeline = self.timelines
        if self.is_multi_turn:  # generation and scoring interleave, turn by turn: one span
            with timeline["generator"].span("generate", step=step, version=self.sampler.version):
                groups = self.env.rollout_groups(self.sampler, problems, n, params[0], self.policy.encode)
            completions = [r.completion for group in groups for r in group]
            t1 = time.perf_counter()
            rollouts = [rollout for group in groups for rollout in group]
        else:
            with timeline["generator"].span("generate", step=step, version=self.sampler.version):
                sampled = generate_groups(self.sampler, [self.policy.encode(p.prompt) for p in problems], n, params)
            completions = [c for group in sampled for c in group]
            t1 = time.perf_counter()
            with timeline["env"].span("score", step=step):
                groups = self.env.score_groups(problems, sampled)
                rollouts = [rollout for group in groups for rollout in group]
        infra_errors = check_infra(rollouts, hint=f" in environment {self.env.name!r}")
        t2 = time.perf_counter()
        staleness = [self.trainer.version - r.completion.oldest_version for r in rollouts]
        assert max(staleness) == 0, f"synchronous loop trained on stale rollouts (staleness {max(staleness)})"
        with timeline["trainer"].span("train", step=step, version=self.trainer.version):
            batch, targets = self.make_batch(rollouts)
            stats = self.trainer.step(batch)
        t3 = time.perf_counter()
        with timeline["trainer"].span("weight_push", version=self.trainer.version):
            self.sampler.update_weights(self.trainer.state_for_push(), self.trainer.version)
        t4 = time.perf_counter()
        gen_tokens = sum(len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask) for c in completions)
        return {
            **rollout_metrics(rollouts, targets.zero_variance_groups, len(problems)),
            **targets.metrics,
            **env_metrics(self.env),
            "sandbox/infra_errors": float(infra_errors),
            **self.train_metrics(stats),
            **staleness_metrics(staleness),
            "perf/generate_s": t1 - t0,
            "perf/score_s": t2 - t1,
            "perf/train_s": t3 - t2,
            "perf/weight_push_s": t4 - t3,
            "perf/step_s": t4 - t0,
            "perf/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            # idle = share of the step's wall time an actor spent not doing its own work
            "perf/trainer_idle_frac": 1.0 - (t3 - t2) / max(t4 - t0, 1e-9),
            "perf/generator_idle_frac": 1.0 - (t1 - t0) / max(t4 - t0, 1e-9),
        }

    @staticmethod
    def train_metrics(stats) -> dict[str, float]:
        return {
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/clip_frac": stats.clip_frac,
            "train/ratio_mean": stats.ratio_mean,
            "train/kl_ref": stats.kl_mean,
            "train/entropy": stats.entropy_mean,
            **stats.offpolicy,
            "train/tokens": float(stats.num_tokens),
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


def _stop_on_signals(loop: SyncLoop) -> None:
    """The first SIGTERM (a scheduler's time limit) or SIGINT lets the running step finish, then
    the run checkpoints and stops (`RunStopped`); a second one interrupts at once."""
    def request_stop(signum, _frame):
        if loop.stop_requested:
            raise KeyboardInterrupt
        loop.stop_requested = signal.Signals(signum).name
        loop.log(f"{loop.stop_requested}: stopping after the current step (send it again to stop at once)")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)


def train(cfg: Config, resume: bool = False, log=print) -> dict:
    """Run a training job: the pipeline (asynchronous up to `pipeline.max_staleness`; 0 is
    synchronous), or this reference loop when `generator.engine = 'reference'` (its simple
    sampler cannot be driven step by step) or the task is multi-turn (the pipeline's generator
    samples single-turn groups)."""
    if cfg.generator.engine == "reference" or cfg.task.name == "tool_use":
        if cfg.pipeline.max_staleness > 0:
            why = "task.name = 'tool_use'" if cfg.task.name == "tool_use" else "generator.engine = 'reference'"
            raise ConfigError(f"pipeline.max_staleness = {cfg.pipeline.max_staleness} needs the pipeline, which {why} "
                              "does not run on; set pipeline.max_staleness = 0")
        loop = SyncLoop(cfg, resume, log)
    else:
        from gapless.orchestrate.pipeline import Pipeline

        loop = Pipeline(cfg, resume, log)
    _stop_on_signals(loop)
    return loop.run()
