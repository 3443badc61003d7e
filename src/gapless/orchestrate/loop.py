"""The run loop: one GRPO run over a rollout source, from the first eval to the summary.

    source.take(t) ──scored groups──> trainer/targets.py step_batch ──> GRPOTrainer.step ──> source.publish
          ^                                                                                        │
          └──────────────────────────────────────── step t + 1 ────────────────────────────────────┘

The loop owns the run: the environment (its eval split), the policy and the trainer, held-out
greedy pass@1 (at the start, every `loop.eval_every` steps and at the end, on this process's own
generator), checkpoints (every `loop.checkpoint_every` steps and at the end; `resume=True`
continues from the last), metrics and the timeline. In a LoRA run (`[lora]`) the trainer trains
adapters on the policy's frozen weights and every push carries the adapters alone; the loop's
own generator merges them as the source's do (generate/adapters.py). Where rollouts come from is the source's
business (source.py): `inline` generates and scores in this process in turn (the reference
loop, inline.py); `process` runs the generator and environment as actors with a staleness budget
(the pipeline, pipeline.py). The trainer sees advantages and masks, never rewards.

Observability: each step logs `perf/step_s`, `perf/train_s`, `perf/weight_push_s`, `perf/weight_push_mb`,
`perf/trainer_idle_frac` (the share of the step spent waiting for rollouts), `perf/peak_rss_mb`
(process_memory.py: against the estimate printed at start), `staleness/*`,
`rollout/*` (with the masking watch's `rollout/infra_*`: what `infra_error` takes out of training,
per step, prompt and policy version, and what it does past `pipeline.max_infra_fraction`;
masking.py, RUN_DIR/masking.json), `train/*`, and the source's own metrics (generator idle, drops, sandbox latency);
the actors write spans to the run's timeline (timeline.py), whose gaps are the waits.

The first SIGTERM or SIGINT lets the running step finish, checkpoints, ends what is in flight as
`run_stopped` and raises RunStopped; a second one interrupts at once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path

import torch

from gapless.config import Config, ConfigError
from gapless.envs.base import Environment, MultiTurnEnvironment, check_infra
from gapless.envs.registry import make_environment
from gapless.envs.turns import EpisodeSteps
from gapless.errors import RunStopped
from gapless.faults import fault_point
from gapless.generate import make_generator
from gapless.generate.protocol import SteppedGenerator
from gapless.lora import run_spec
from gapless.metrics import open_sinks
from gapless.models import load_local
from gapless.orchestrate.evaluate import EvalScore, greedy_pass_at_1, multi_turn_pass_at_1
from gapless.orchestrate.inline import InlineSource
from gapless.orchestrate.masking import MaskingWatch
from gapless.orchestrate.memory_fit import check_fits
from gapless.orchestrate.policy_setup import prepare_policy
from gapless.orchestrate.process_memory import peak_rss_metrics
from gapless.orchestrate.source import RolloutSource
from gapless.orchestrate.step_metrics import rollout_metrics, staleness_metrics, train_metrics
from gapless.timeline import export_chrome_trace, open_timeline
from gapless.trainer.checkpoint import (
    checkpoint_model_dir,
    latest_checkpoint,
    load_checkpoint_adapter,
    load_trainer_state,
    save_checkpoint,
)
from gapless.trainer.distributed import make_trainer
from gapless.trainer.targets import step_batch

ACTORS = ("generator", "env", "trainer")  # timeline rows of this process
SOURCES = ("inline", "process")


def source_kind(cfg: Config, env: Environment, custom_env: bool = False) -> str:
    """`process` (the pipeline) unless the generator cannot be driven step by step (the
    `reference` engine), the environment is multi-turn without running one turn at a time
    (`EpisodeSteps`: tool_use and repo do), or it is an object the caller built (the actors build
    theirs from `task.name`): then `inline`, which only runs synchronously."""
    why = None
    if cfg.generator.engine == "reference":
        why = "generator.engine = 'reference'"
    elif isinstance(env, MultiTurnEnvironment) and not isinstance(env, EpisodeSteps):
        why = f"the multi-turn task {env.name!r}"
    elif custom_env:
        why = f"a custom environment object ({env.name!r})"
    if why is None:
        return "process"
    if cfg.pipeline.max_staleness > 0:
        raise ConfigError(
            f"pipeline.max_staleness = {cfg.pipeline.max_staleness} needs the pipeline, which {why} "
            "does not run on; set pipeline.max_staleness = 0"
        )
    return "inline"


class RunLoop:
    def __init__(
        self, cfg: Config, resume: bool = False, log=print, env: Environment | None = None, source: str | None = None
    ):
        """`env`: an environment object to train on instead of the one `task.name` names (a
        custom environment, examples/reverse_env.py); the loop closes it at the end.
        `source`: 'inline' or 'process'; None chooses as `source_kind` does."""
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        self.env: Environment = env if env is not None else make_environment(cfg)
        try:
            kind = source or source_kind(cfg, self.env, custom_env=env is not None)
            if kind not in SOURCES:
                raise ConfigError(f"rollout source {kind!r} is not one of {SOURCES}")
            if kind == "process":
                torch.set_num_threads(cfg.pipeline.trainer_threads_resolved)
            if cfg.trainer.threads:
                torch.set_num_threads(cfg.trainer.threads)
            self.is_multi_turn = isinstance(self.env, MultiTurnEnvironment)
            if self.is_multi_turn and cfg.cluster.env_actors > 1:
                raise ConfigError(
                    f"cluster.env_actors = {cfg.cluster.env_actors}: the episodes of the multi-turn task "
                    f"{self.env.name!r} run in one environment actor; set cluster.env_actors = 1"
                )
            self.train, self.eval = list(self.env.tasks("train")), list(self.env.tasks("eval"))
            if len(self.train) < cfg.loop.prompts_per_step and cfg.loop.steps > 0:
                raise ConfigError(
                    f"task {self.env.name!r} has {len(self.train)} train tasks, fewer than loop.prompts_per_step "
                    f"({cfg.loop.prompts_per_step}); an eval-only set (humaneval) is for `gapless eval`"
                )
            self._setup(cfg, resume, log, kind)
        except BaseException:
            self.env.close()
            raise

    def _setup(self, cfg: Config, resume: bool, log, kind: str) -> None:
        self.lora = run_spec(cfg.lora, cfg.seed)  # None: full fine-tuning
        self.policy, self.setup_info = prepare_policy(cfg, self.env, log)
        self._keep_prompts()
        estimate = check_fits(
            cfg, self.policy.model, self.max_seq_len(), log
        )  # before any rollout: refuse what cannot fit
        self.setup_info["memory_estimate_mb"] = estimate.total / (1 << 20)
        self.start_step, self.state = 0, {}
        checkpoint = latest_checkpoint(self.run_dir) if resume else None
        if checkpoint is not None:
            self.policy = load_local(checkpoint_model_dir(checkpoint, self.lora is not None))
            self._keep_prompts()
        # the pipeline's placement comes first: the trainer's ranks 1..W-1 are placed beside its actors
        placement = self._placement(cfg, log) if kind == "process" else None
        try:
            ranks = placement.trainer_ranks() if placement is not None and cfg.cluster.trainer_world_size > 1 else None
            self.trainer = make_trainer(
                cfg.trainer,
                self.policy.model,
                cfg.cluster,
                cfg.generator.temperature,
                cfg.generator.max_new_tokens,
                self.lora,
                ranks,
            )
            self._build(cfg, resume, log, kind, checkpoint, placement)
        except BaseException:
            if placement is not None:
                placement.shutdown(None, 0.0)
            raise

    @staticmethod
    def _placement(cfg: Config, log):
        from gapless.cluster import make_placement
        from gapless.orchestrate.pipeline import actor_threads

        placement = make_placement(cfg, log)
        if warning := placement.reserve(actor_threads(cfg)):
            log(f"warning: {warning}")
        return placement

    def _build(self, cfg: Config, resume: bool, log, kind: str, checkpoint, placement) -> None:
        if checkpoint is not None:
            if self.lora is not None:
                load_checkpoint_adapter(checkpoint, self.trainer.model)
            self.state = load_trainer_state(checkpoint, self.trainer.optimizer)
            self.start_step = self.trainer.version = self.state["step"]
            log(f"resumed from {checkpoint} at step {self.start_step}")
        self.sampler = make_generator(cfg.generator, self.policy, self.max_seq_len(), self.run_dir, lora=self.lora)
        if self.lora is not None:  # the engine holds the base: give it the (resumed) adapters
            self.sampler.update_weights(self.trainer.state_for_push(), self.trainer.version)
        self.sampler.version = self.trainer.version
        self.stop_requested: str | None = None  # set by a signal handler (train()): the signal's name
        self.timelines = {actor: open_timeline(self.run_dir, actor, cfg.metrics.timeline) for actor in ACTORS}
        self.masking = MaskingWatch(cfg.pipeline.max_infra_fraction, cfg.pipeline.on_infra_excess)
        self.source: RolloutSource
        if kind == "inline":
            self.source = InlineSource(
                cfg, self.env, self.train, self.sampler, self.policy.encode, self.timelines, self.masking
            )
        else:
            if not isinstance(self.sampler, SteppedGenerator):
                raise ConfigError(
                    f"generator.engine = '{cfg.generator.engine}' cannot run the pipeline: use 'torch' or 'vllm'"
                )
            from gapless.orchestrate.pipeline import ProcessSource

            self.source = ProcessSource(
                cfg,
                self.train,
                self.policy,
                self.start_step,
                resume,
                self.env.name,
                self.timelines,
                lambda: self.stop_requested,
                log,
                trained_model=self.trainer.model if self.lora is not None else None,
                multi_turn=self.is_multi_turn,
                max_seq_len=self.max_seq_len(),
                placement=placement,
                masking=self.masking,
            )
        self.sinks = open_sinks(cfg, cfg.loop.steps, append=checkpoint is not None)

    def _keep_prompts(self) -> None:
        """Each task's prompt encoded once in this process, whoever asks for it (the source, eval)."""
        self.policy.encode.keep(p.prompt for p in self.train + self.eval)

    def max_seq_len(self) -> int:
        """Longest context the generator must hold: the longest prompt plus the completion cap."""
        longest = max(len(self.policy.encode(p.prompt)) for p in self.train + self.eval)
        if self.is_multi_turn:  # every turn and every tool output stays in the context
            return self.env.max_context_tokens(longest, self.cfg.generator.max_new_tokens)
        return longest + self.cfg.generator.max_new_tokens

    def evaluate(self) -> EvalScore:
        """Greedy pass@1 on the trainer's current weights, on this process's generator."""
        with self.timelines[self.source.eval_actor].span("eval", version=self.trainer.version):
            if self.sampler.version != self.trainer.version:
                self.sampler.update_weights(self.trainer.state_for_push(), self.trainer.version)
            if self.is_multi_turn:
                return multi_turn_pass_at_1(
                    self.sampler, self.env, self.eval, self.policy.encode, self.cfg.generator.max_new_tokens
                )
            return greedy_pass_at_1(
                self.sampler, self.env, self.eval, self.policy.encode, self.cfg.generator.max_new_tokens
            )

    def run(self) -> dict:
        reason = "run_failed"
        try:
            self.source.start(self.trainer.state_for_push(), self.trainer.version)
            summary = self._run()
            reason = "run_ended"
            return summary
        except (RunStopped, KeyboardInterrupt):
            reason = "run_stopped"
            raise
        finally:  # also on error or Ctrl-C: the live view restores the terminal, files are flushed
            try:
                self.masking.write(self.run_dir / "masking.json")
                if (close := getattr(self.trainer, "close", None)) is not None:
                    close()  # data-parallel ranks leave first: Ray ranks live in the source's placement
                self.source.close(reason, self.trainer.version)
            finally:
                self.sinks.close()
                for timeline in self.timelines.values():
                    timeline.close()
                self.env.close()
                if self.cfg.metrics.timeline:
                    export_chrome_trace(self.run_dir)

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
            self.masking.write(self.run_dir / "masking.json")
            if done % cfg.loop.checkpoint_every == 0 or done == cfg.loop.steps:
                self.checkpoint(done, pass_start, trained_samples)
        summary = {
            "eval/pass@1_start": pass_start,
            "eval/pass@1_end": pass_now,
            "wall_s": time.perf_counter() - started + self.setup_info.get("warmstart_s", 0.0),
            "rl_wall_s": time.perf_counter() - started,
            "trained_samples": trained_samples,
            "steps": cfg.loop.steps,
            **peak_rss_metrics(),
            **self.setup_info,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def train_step(self, step: int) -> dict[str, float]:
        """One GRPO step: take step `step`'s groups from the source, train, publish version step + 1."""
        cfg = self.cfg
        taken = self.source.take(step)
        fault_point("trainer", "step")
        rollouts = taken.rollouts
        infra_errors = check_infra(rollouts, hint=f" in environment {self.env.name!r}")
        t1 = time.perf_counter()
        with self.timelines["trainer"].span("train", step=step, version=self.trainer.version), self.source.training():
            batch, targets = step_batch(
                taken.groups, cfg.trainer, cfg.generator.max_new_tokens, self.policy.pad_id, self.trainer.reference_kl
            )
            stats = self.trainer.step(batch)
        t2 = time.perf_counter()
        with self.timelines["trainer"].span("weight_push", version=self.trainer.version):
            state = self.trainer.state_for_push()  # LoRA: the adapters alone
            push = self.source.publish(state, self.trainer.version)
        t3 = time.perf_counter()
        step_s = t3 - taken.started
        return {
            **rollout_metrics(rollouts, targets.zero_variance_groups, len(taken.groups)),
            **targets.metrics,
            "sandbox/infra_errors": float(infra_errors),
            **train_metrics(stats),
            **staleness_metrics([step - r.completion.oldest_version for r in rollouts]),
            "perf/step_s": step_s,  # the process source: from the end of the previous step
            "perf/train_s": t2 - t1,
            "perf/weight_push_s": t3 - t2,
            "perf/weight_push_mb": sum(t.numel() * t.element_size() for t in state.values()) / 1e6,
            "perf/trainer_idle_frac": taken.waited_s / max(step_s, 1e-9),
            "perf/trained_tokens_per_s": stats.num_tokens / max(t2 - t1, 1e-9),
            **push,
            **taken.metrics,
            **self.source.stats(),
            **self.masking.step_metrics(),
            **peak_rss_metrics(),
        }

    def checkpoint(self, step: int, pass_start: float, trained_samples: int) -> None:
        save_checkpoint(
            self.run_dir,
            self.policy,
            self.trainer.optimizer,
            step,
            {"pass@1_start": pass_start, "trained_samples": trained_samples},
            adapted=self.trainer.model if self.lora is not None else None,
        )


@contextlib.contextmanager
def _stop_on_signals(loop: RunLoop):
    """The first SIGTERM (a scheduler's time limit) or SIGINT lets the running step finish, then
    the run checkpoints and stops (`RunStopped`); a second one interrupts at once. The handlers
    before the run come back after it (a caller's own, e.g. a test runner's)."""

    def request_stop(signum, _frame):
        if loop.stop_requested:
            raise KeyboardInterrupt
        loop.stop_requested = signal.Signals(signum).name
        loop.log(f"{loop.stop_requested}: stopping after the current step (send it again to stop at once)")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def train(cfg: Config, resume: bool = False, log=print) -> dict:
    """Run a training job: the pipeline (asynchronous up to `pipeline.max_staleness`; 0 is
    synchronous), or the inline reference loop where the pipeline cannot run (`source_kind`)."""
    loop = RunLoop(cfg, resume, log)
    with _stop_on_signals(loop):
        return loop.run()
