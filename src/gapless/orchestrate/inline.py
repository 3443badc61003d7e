"""The inline rollout source: the reference synchronous loop's generate-then-score, in turn.

    take(t):  generator.generate(N per prompt) ──> env.score_groups      (one process, strictly in turn)
              or, for a multi-turn environment, env.rollout_groups (it drives generation itself, in
              lock-step waves (envs/turns.py), each group with its own seed; its completions' loss
              masks keep the environment's tokens out of the loss)
    publish:  generator.update_weights(state, v)

Every rollout of a step is sampled by the current policy version (staleness 0, asserted), so the
behaviour log-probs the generator records are the trainer's old log-probs. Prompts are chosen by
`sample_step_tasks` and sampling seeds by `sampling_params`, exactly as the pipeline numbers its
groups, which is what makes the pipeline at budget 0 equal to this source bitwise. Works with any
generator, including the `reference` engine that cannot be driven step by step.
"""

from __future__ import annotations

import contextlib
import time

from gapless.config import Config
from gapless.envs.base import Environment, MultiTurnEnvironment, Task
from gapless.generate.groups import generate_groups
from gapless.orchestrate.admission import sample_step_tasks, sampling_params
from gapless.orchestrate.masking import MaskingWatch
from gapless.orchestrate.source import StepRollouts
from gapless.orchestrate.step_metrics import env_metrics
from gapless.types import Group


class InlineSource:
    eval_actor = "generator"

    def __init__(
        self,
        cfg: Config,
        env: Environment,
        train: list[Task],
        sampler,
        encode,
        timelines,
        masking: MaskingWatch | None = None,
    ):
        """`masking`: the run's masking watch (masking.py); it sees every scored group."""
        self.cfg, self.env, self.train = cfg, env, train
        self.masking = masking or MaskingWatch(cfg.pipeline.max_infra_fraction, cfg.pipeline.on_infra_excess)
        self.sampler, self.encode, self.timelines = sampler, encode, timelines
        self._started = 0.0

    def start(self, state, version: int) -> None:
        pass  # the generator already holds these weights

    def take(self, step: int) -> StepRollouts:
        cfg, t0 = self.cfg, time.perf_counter()
        picks = sample_step_tasks(cfg.seed, step, len(self.train), cfg.loop.prompts_per_step)
        problems = [self.train[i] for i in picks]
        n = cfg.generator.group_size
        first = step * len(problems)  # group indices as the pipeline numbers them
        params = [sampling_params(cfg, first + g) for g in range(len(problems))]
        with self.timelines["generator"].span("generate", step=step, version=self.sampler.version):
            if isinstance(self.env, MultiTurnEnvironment):  # generation and scoring interleave, turn by turn
                groups = self.env.rollout_groups(self.sampler, problems, n, params, self.encode)
            else:
                sampled = generate_groups(self.sampler, [self.encode(p.prompt) for p in problems], n, params)
        t1 = time.perf_counter()
        if not isinstance(self.env, MultiTurnEnvironment):
            with self.timelines["env"].span("score", step=step):
                groups = self.env.score_groups(problems, sampled)
        t2 = time.perf_counter()
        groups = [self.masking.observe(task.uid, list(group)) for task, group in zip(problems, groups)]
        rollouts = [r for group in groups for r in group]
        staleness = max(step - r.completion.oldest_version for r in rollouts)
        assert staleness == 0, f"the inline source sampled stale rollouts (staleness {staleness})"
        gen_tokens = sum(
            len(r.completion.token_ids) if r.completion.loss_mask is None else sum(r.completion.loss_mask)
            for r in rollouts
        )
        self._started, self._generate_s = t0, t1 - t0
        groups = [
            Group(index=first + g, task_index=picks[g], born=step, rollouts=tuple(scored))
            for g, scored in enumerate(groups)
        ]
        return StepRollouts(
            groups,
            t0,
            t2 - t0,
            {
                "perf/generate_s": t1 - t0,
                "perf/score_s": t2 - t1,
                "perf/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            },
        )

    def training(self):
        return contextlib.nullcontext()

    def publish(self, state, version: int) -> dict[str, float]:
        self.sampler.update_weights(state, version)
        return {}

    def stats(self) -> dict[str, float]:
        step_s = time.perf_counter() - self._started
        # idle = share of the step's wall time the generator was not generating
        return {**env_metrics(self.env), "perf/generator_idle_frac": 1.0 - self._generate_s / max(step_s, 1e-9)}

    def close(self, reason: str, version: int) -> None:
        pass
