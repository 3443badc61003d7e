"""Typed messages between the pipeline's processes (pickled through multiprocessing queues).

    trainer ──Assign──> generator replica r ──ToScore (its own queue)──> environment ──Scored──> trainer
       ^──── Loaded / Ready / GenStats / ActorError (each actor's own outbox) ─────────────────────┘
    generator replica r <── Abort (stragglers it holds) ── trainer ── CancelScoring ──> environment

Multi-turn episodes (episode_runner.py) add a loop between a replica and the environment:
    replica r ──StartEpisodes, TurnDone (its ToScore queue)──> environment ──NextTurns (r's own queue)──> replica r

Each queue carries one family of these records and has one writer, so an actor killed in the
middle of a write cannot block another; receivers dispatch on the type, never on a string tag.
Everything here is plain data: no locks, tensors or open files.
"""

from __future__ import annotations

from dataclasses import dataclass

from gapless.envs.turns import TurnRequest
from gapless.types import Admitted, Completion, Group


# ---- to the trainer ----------------------------------------------------------------------
@dataclass(frozen=True)
class Loaded:
    replica: int
    version: int  # the policy version the replica now samples with (at start, then after every swap)


@dataclass(frozen=True)
class Scored:
    group: Group
    gen_stats: GenStats | None = None  # the replica's report that travelled with the group (ToScore.gen_stats)


@dataclass(frozen=True)
class Ready:
    actor: str  # "generator" (or "generator-<r>") | "environment" (or "environment-<e>"): set up and about to work


@dataclass(frozen=True)
class GenStats:
    stats: dict  # busy / idle / stall seconds, tokens, groups ... since the last report


@dataclass(frozen=True)
class ActorError:
    actor: str
    traceback: str


# ---- to a generator replica ----------------------------------------------------------------
@dataclass(frozen=True)
class Assign:
    groups: tuple[Admitted, ...]  # each group to start
    scorers: tuple[int, ...] = ()  # the environment slot that scores each group (empty: slot 0)


@dataclass(frozen=True)
class Abort:
    indices: tuple[int, ...]  # groups cut as stragglers: stop generating them


# ---- to the environment ------------------------------------------------------------------
@dataclass(frozen=True)
class ToScore:
    index: int
    task_index: int
    born: int
    completions: list[Completion]
    gen_stats: GenStats | None = None  # the replica's report, sent with the group that emptied it (see actors.py)


@dataclass(frozen=True)
class CancelScoring:
    indices: tuple[int, ...]  # cut groups: skip them if queued, discard them if being scored


# ---- multi-turn episodes: replica <-> environment -------------------------------------------
@dataclass(frozen=True)
class StartEpisodes:
    replica: int  # where the episodes' turns are sampled
    groups: tuple[tuple[int, int, int], ...]  # (index, task index, birth version), as assigned


@dataclass(frozen=True)
class TurnDone:
    group: int
    completion: Completion  # one sampled turn; completion.index is the episode's sample index


@dataclass(frozen=True)
class NextTurns:
    turns: tuple[TurnRequest, ...]  # to queue at once, in this order (a wave's turn, or one episode's)
