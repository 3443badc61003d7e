"""Rollout sources: where the run loop's scored groups come from, behind one small Protocol.

    RunLoop (loop.py), per step t:
        source.take(t) ──> scored groups ──> GRPO step (trainer/) ──> source.publish(weights, t + 1)

Two sources implement it:
    InlineSource   (inline.py)    the reference loop: generate, then score, in this process, in turn
    ProcessSource  (pipeline.py)  the pipeline: generator and environment actors, placed by a
                                  Placement (cluster/placement.py), bounded by the staleness budget

What every source guarantees to the loop (tests/integration/test_sources.py runs one contract over
each): `take(t)` returns exactly `loop.prompts_per_step` groups of `generator.group_size` scored
rollouts each, every token sampled by a policy version in [t - max_staleness, t]; `publish(state,
v)` makes version v the weights of every later sample, and a source never mixes the tokens of two
versions without recording each token's version; at budget 0 every source yields the same groups
for the same seed (so the same weights). `close(reason, version)` ends whatever is in flight with
that reason and frees the source's processes; it is called exactly once, also after a failure.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from gapless.types import Group, Rollout


@dataclass
class StepRollouts:
    """One step's input: `groups` in batch order (admission order), `started`
    (perf_counter when the step began, for perf/step_s) and `waited_s` (how long the trainer
    waited for them: its idle time in this step)."""

    groups: list[Group]
    started: float
    waited_s: float
    metrics: dict[str, float] = field(default_factory=dict)  # the source's own, for this step

    @property
    def rollouts(self) -> list[Rollout]:
        return [rollout for group in self.groups for rollout in group.rollouts]


@runtime_checkable
class RolloutSource(Protocol):
    eval_actor: str  # the timeline row evaluation runs on ('generator' inline, 'trainer' in the pipeline)

    def start(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Start producing with `state` as policy version `version` (spawn actors, open
        sandboxes); called once, before the first take."""

    def take(self, step: int) -> StepRollouts:
        """Block until step `step`'s groups are scored, then hand them over (bounded: a source
        whose producers die or stall raises an InfrastructureError)."""

    def training(self) -> AbstractContextManager[None]:
        """Wraps the trainer's compute between take and publish: a source may go on admitting
        work meanwhile and lend the trainer threads it is not using."""

    def publish(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Make `state` policy version `version` for every later sample; returns push metrics."""

    def stats(self) -> dict[str, float]:
        """The source's metrics for the step just published (generator busy/idle, drops, ...)."""

    def close(self, reason: str, version: int) -> None:
        """End what is in flight with `reason` (run_ended, run_stopped, run_failed) and stop."""
