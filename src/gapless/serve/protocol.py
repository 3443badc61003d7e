"""Typed records between the scheduler and its clients (HTTP routes, the judge, later Tinker and agents).

    SampleRequest ──submit──> Scheduler ──> RequestHandle ──> SampleDelta* per step ──> SampleResult per sample

Every record is plain data, so the boundary between the engine thread and its clients could be
moved behind a pipe without changing either side. `ServeError`s carry the HTTP status and the
OpenAI error `type`/`code`/`param` they become; they are raised in the caller's thread by
`Scheduler.submit`, never inside the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gapless.generate.constraint import TokenConstraint
from gapless.types import FinishReason, SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    """`n` samples of one prompt; sample j draws from the random stream (params.seed, j), as
    `TorchEngine.add_request(prompt_ids, params, n)` would."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()  # strings that end a sample; its text stops before the first one
    source: str = "http"  # which client kind submitted it (metrics, and who shared a batch)
    stream: bool = False  # keep per-step deltas for `deltas()`; off: only the final result
    constraint: Callable[[], TokenConstraint] | None = None  # a fresh grammar state per sample (serve/grammar.py)


@dataclass
class SampleDelta:
    """What one engine step added to one sample (a stream's unit)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str  # new text, held back while it could still be the start of a stop string
    finish_reason: FinishReason | None = None  # set on the sample's last delta


def merge_deltas(deltas: list[SampleDelta]) -> list[SampleDelta]:
    """One delta per sample, in first-seen order: what a consumer that fell behind sends as one
    chunk instead of several (the tokens, text and finish reason of each sample, concatenated)."""
    merged: dict[int, SampleDelta] = {}
    for d in deltas:
        if (m := merged.get(d.index)) is None:
            merged[d.index] = SampleDelta(
                d.index, list(d.token_ids), list(d.logprobs), list(d.versions), d.text, d.finish_reason
            )
        else:
            m.token_ids += d.token_ids
            m.logprobs += d.logprobs
            m.versions += d.versions
            m.text += d.text
            m.finish_reason = d.finish_reason
    return list(merged.values())


@dataclass
class SampleResult:
    """One finished sample. `token_ids` are all the tokens sampled (the EOS, and the tokens that
    spelled a stop string, included); `text` excludes the EOS and anything from a stop string on."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


class ServeError(Exception):
    """A request the scheduler or the API refuses; `status` is the HTTP status it becomes."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class InvalidRequest(ServeError):
    pass


class ContextLengthExceeded(ServeError):
    code = "context_length_exceeded"


class QueueFull(ServeError):
    status, type, code = 429, "rate_limit_error", "queue_full"


class SchedulerClosed(ServeError):
    status, type, code = 503, "server_error", "shutting_down"
