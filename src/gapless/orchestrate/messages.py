"""Typed messages between the pipeline's processes (pickled through multiprocessing queues).

    generator ──ToScore──────────────> environment ──Scored──> trainer
        │  ──Admitted / Ready / GenStats / ActorError ─────────────^
        ^── Dropped (backfill) / Abort (stragglers) / Feedback (curriculum) ── trainer, environment
    environment ^── CancelScoring (stragglers the trainer cut) ──────────────── trainer

Each queue carries one family of these records; receivers dispatch on the type, never on a
string tag. Everything here is plain data: no locks, tensors or open files.
"""

from __future__ import annotations

from dataclasses import dataclass

from gapless.orchestrate.buffer import ScoredGroup
from gapless.types import Completion


# ---- to the trainer ----------------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    index: int  # admission order within the segment
    task_index: int
    born: int  # the generator's policy version when it admitted the group


@dataclass(frozen=True)
class Scored:
    group: ScoredGroup


@dataclass(frozen=True)
class Ready:
    actor: str  # "generator" | "environment": set up and about to work


@dataclass(frozen=True)
class GenStats:
    stats: dict  # busy / idle / stall seconds, tokens, groups ... since the last report


@dataclass(frozen=True)
class ActorError:
    actor: str
    traceback: str


# ---- to the generator --------------------------------------------------------------------
@dataclass(frozen=True)
class Dropped:
    count: int  # places freed for backfills
    min_version: int  # a backfill may only be born at this policy version or later (budget)


@dataclass(frozen=True)
class Abort:
    indices: tuple[int, ...]  # groups cut as stragglers: stop generating them


@dataclass(frozen=True)
class Feedback:
    uid: str
    rewards: tuple[float, ...]  # the group's valid rewards, for the curriculum


# ---- to the environment ------------------------------------------------------------------
@dataclass(frozen=True)
class ToScore:
    index: int
    task_index: int
    born: int
    completions: list[Completion]


@dataclass(frozen=True)
class CancelScoring:
    indices: tuple[int, ...]  # cut groups: skip them if queued, discard them if being scored
