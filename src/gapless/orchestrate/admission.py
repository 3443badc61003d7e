"""Admission control: how many groups the generator may have started, and which prompt is next.

With P groups per trainer step and a staleness budget s, a generator holding policy version v
may have admitted at most

    (v + s + 1) * P + extra + dropped          groups in total (since step 0),

where `extra` is the oversampling allowance and `dropped` counts groups the trainer dropped
(zero variance, stragglers, infrastructure failures), each of which frees one place so it can be
backfilled. With s = 0 and no extra, the generator starts exactly the P groups of step v and then
waits for version v + 1: the synchronous loop. Together with the trainer's rule of consuming
every group that would otherwise leave the budget (buffer.py), no group is ever consumed staler
than s; the bound here only keeps the number of such groups within one step's batch.

`PromptSource` decides which task each admitted group gets: uniformly, in the same order as the
reference synchronous loop (`sample_step_tasks`), or by the pass-rate curriculum.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Sequence

from gapless.config import Config
from gapless.orchestrate.curriculum import PassRateCurriculum
from gapless.types import SamplingParams


class Admission:
    """The staleness budget at admission, in one place: the count above and the born-stale guard
    (dispatch.py explains it), for groups born at `version`."""

    def __init__(self, groups_per_step: int, max_staleness: int, oversample: float, start_step: int = 0):
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.extra = math.ceil(oversample * groups_per_step)
        self.admitted = start_step * groups_per_step  # group indices continue after a resume
        self.dropped = 0
        self.min_birth = start_step - max_staleness  # a group born earlier would be due before `start_step`

    def limit(self, version: int) -> int:
        return (version + self.max_staleness + 1) * self.groups_per_step + self.extra + self.dropped

    def may_admit(self, version: int) -> bool:
        return version >= self.min_birth and self.admitted < self.limit(version)

    def assembling(self, step: int) -> None:
        """The trainer now fills step `step`'s batch: a group born earlier than step - budget
        would already be due."""
        self.min_birth = max(self.min_birth, step - self.max_staleness)

    def freed(self, count: int) -> None:
        """`count` admitted groups were dropped: as many places open for backfills."""
        self.dropped += count

    def admit(self) -> int:
        """The next group's index (its place in admission order)."""
        index = self.admitted
        self.admitted += 1
        return index


def sample_step_tasks(seed: int, step: int, num_tasks: int, per_step: int) -> list[int]:
    """Indices of the tasks of `step` under uniform sampling (without replacement within a step)."""
    return random.Random(f"{seed}-prompts-{step}").sample(range(num_tasks), per_step)


def group_seed(seed: int, index: int) -> int:
    """The sampling seed of group `index` of a run: the same in every loop and process."""
    return seed * 1_000_003 + index


def sampling_params(cfg: Config, index: int) -> SamplingParams:
    """How group `index` of a run is sampled (its own seed; a synthetic straggler if configured)."""
    params = SamplingParams(
        cfg.generator.temperature, cfg.generator.top_p, cfg.generator.max_new_tokens, seed=group_seed(cfg.seed, index)
    )
    every = cfg.generator.force_long_every
    if every and index % every == every - 1:
        params = replace(params, ignore_eos=True)  # a synthetic straggler: runs to max_new_tokens
    return params


class PromptSource:
    """Task index for each admitted group. 'uniform' reproduces the synchronous loop's order:
    group k is task `sample_step_tasks(seed, k // P, ...)[k % P]`, backfills included (they just
    take the next place). 'pass_rate' draws from the curriculum instead."""

    def __init__(self, seed: int, task_uids: Sequence[str], groups_per_step: int, curriculum: str = "uniform"):
        self.seed, self.uids, self.per_step = seed, list(task_uids), groups_per_step
        self.curriculum = PassRateCurriculum(self.uids, seed) if curriculum == "pass_rate" else None
        self._step_cache: tuple[int, list[int]] | None = None

    def task_for(self, index: int) -> int:
        if self.curriculum is not None:
            return self.curriculum.pick()
        step, place = divmod(index, self.per_step)
        if self._step_cache is None or self._step_cache[0] != step:
            self._step_cache = (step, sample_step_tasks(self.seed, step, len(self.uids), self.per_step))
        return self._step_cache[1][place]

    def feedback(self, uid: str, rewards: list[float]) -> None:
        if self.curriculum is not None:
            self.curriculum.update(uid, rewards)
