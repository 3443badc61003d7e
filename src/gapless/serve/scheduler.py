"""The request scheduler: one engine thread in front of one engine, shared by every client.

The engine is any `StreamingGenerator` (generate/protocol.py): the torch engine or vLLM's
(`generate.serving_engine` builds either), driven through the same calls.

HTTP routes, the judge environment and (later) the Tinker service and agents all `submit` here;
their samples join the engine's continuous batch as they arrive and leave it as they finish.
Who waits for whom:

    client threads / event loop                     engine thread (owns the engine)
    ───────────────────────────                     ────────────────────────────────
    submit(request) ─ checks, reserves ─> inbox ──> drain inbox: submit / abort / weights / close
    handle.abort()  ───────────────────> inbox      engine.step()          (blocks when idle)
    handle.result() / deltas()   <── lock+notify ── publish: per sample, new tokens, text, finish
    await handle.aresult() / adeltas() <── one call_soon_threadsafe per event loop per step

The engine is touched by the engine thread only; its only mutators are inbox commands. Every
sample of a request is its own engine request (`<handle>/<j>`) with the random stream
(seed, j), so one sample can end on a stop string while its siblings go on, and the tokens equal
those of `engine.add_request(prompt, params, n)`.

Guaranteed: a request that does not fit the context (`len(prompt) + max_new_tokens >
max_seq_len`), or would take the samples in flight past `max_samples`, is refused in `submit`
(a `ServeError`, raised in the caller's thread) before anything reaches the engine; an abort
frees a sample's slot at the next engine-thread turn (running or waiting), and aborting a
finished request is a no-op; every handle leaves `num_handles` on finish, abort, error or close
(an engine error or `close()` fails every request in flight with a ServeError: 500 or 503).
A stop string ends decoding at the token that completes it. Not guaranteed: fairness between
sources beyond arrival order (the engine admits first come, first served), or that float
rounding of a sample is independent of what else shares its batch.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import torch

from gapless.generate.protocol import StreamingGenerator
from gapless.generate.sampling import sample_seed
from gapless.serve.detokenize import SampleText
from gapless.serve.protocol import (
    ContextLengthExceeded,
    InvalidRequest,
    QueueFull,
    SampleDelta,
    SampleRequest,
    SampleResult,
    SchedulerClosed,
    ServeError,
)
from gapless.types import Completion, FinishReason


class EngineFailed(ServeError):
    status, type, code = 500, "server_error", "engine_error"


@dataclass
class SchedulerStats:
    """Counters since start (read from any thread; written by the engine thread and `submit`)."""

    submitted: int = 0
    rejected: int = 0  # refused by a full queue
    aborted_samples: int = 0
    finished_samples: int = 0
    steps: int = 0  # engine steps with something running
    tokens: int = 0  # completion tokens published
    batch_sources: Counter = field(default_factory=Counter)  # frozenset of sources in a step's batch -> steps


class RequestHandle:
    """One submitted request: its samples' results, and their per-step deltas when streamed."""

    def __init__(self, scheduler: Scheduler, handle_id: str, request: SampleRequest):
        self.id, self.request = handle_id, request
        self.results = [SampleResult(j, list(request.prompt_ids)) for j in range(request.n)]
        self.error: ServeError | None = None
        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: list[SampleDelta] = []
        self._open = request.n  # samples not finished yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    @property
    def done(self) -> bool:
        return self._open == 0

    def abort(self) -> None:
        """Stop every unfinished sample (idempotent; their finish reason becomes 'abort')."""
        if not self.done:
            self._scheduler._inbox.put(_Abort(self))

    # ---- consumers ------------------------------------------------------------------------
    def result(self, timeout_s: float | None = None) -> list[SampleResult]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._open == 0, timeout_s):
                raise TimeoutError(f"request {self.id} did not finish within {timeout_s} s")
        return self._results()

    def deltas(self) -> Iterator[list[SampleDelta]]:
        """Blocking: the deltas published since the last yield, until every sample finished."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._open == 0)
                batch, self._pending, finished = self._pending, [], self._open == 0
            if batch:
                yield batch
            if finished:
                self._raise()
                return

    async def aresult(self) -> list[SampleResult]:
        while not await self._await_change(pending=False):
            pass
        return self._results()

    async def adeltas(self) -> AsyncIterator[list[SampleDelta]]:
        while True:
            finished = await self._await_change(pending=True)
            with self._lock:
                batch, self._pending = self._pending, []
            if batch:
                yield batch
            if finished and not self._pending:
                self._raise()
                return

    async def _await_change(self, pending: bool) -> bool:
        """Wait until the request finished (or, with `pending`, has deltas to take); returns finished."""
        with self._lock:
            if self._open == 0:
                return True
            if pending and self._pending:
                return False
            if self._event is None:
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
            self._event.clear()
        await self._event.wait()
        return self._open == 0

    def _results(self) -> list[SampleResult]:
        self._raise()
        return self.results

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- engine thread --------------------------------------------------------------------
    def _publish(self, delta: SampleDelta) -> tuple[asyncio.AbstractEventLoop, asyncio.Event] | None:
        with self._cond:
            res = self.results[delta.index]
            res.token_ids += delta.token_ids
            res.logprobs += delta.logprobs
            res.versions += delta.versions
            res.text += delta.text
            if self.request.stream:
                self._pending.append(delta)
            if delta.finish_reason is not None:
                res.finish_reason = delta.finish_reason
                self._open -= 1
            self._cond.notify_all()
            return (self._loop, self._event) if self._event is not None else None

    def _fail(self, error: ServeError) -> tuple[asyncio.AbstractEventLoop, asyncio.Event] | None:
        with self._cond:
            self.error, self._open = error, 0
            self._cond.notify_all()
            return (self._loop, self._event) if self._event is not None else None


@dataclass
class _Live:
    """Engine-thread bookkeeping of one running or waiting sample."""

    handle: RequestHandle
    index: int
    text: SampleText | None  # per-step text: streams and stop strings only
    sent: int = 0  # tokens already published


@dataclass
class _Submit:
    handle: RequestHandle


@dataclass
class _Abort:
    handle: RequestHandle


@dataclass
class _Weights:
    state: dict[str, torch.Tensor]
    version: int


@dataclass
class _Close:
    pass


class Scheduler:
    """Owns `engine` on its own thread. `max_samples`: samples in flight (running + waiting) beyond
    which `submit` answers `QueueFull` (HTTP 429); size it a few times the engine's batch."""

    def __init__(
        self,
        engine: StreamingGenerator,
        decode: Callable[[list[int]], str],
        *,
        max_samples: int = 512,
        name: str = "gapless-scheduler",
    ):
        self.engine, self.max_samples = engine, max_samples
        self.max_seq_len = engine.max_seq_len
        self.stats = SchedulerStats()
        self._decode = decode
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the reservation count and `_closed`
        self._in_flight = 0
        self._closed = False
        self._ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._live: dict[str, _Live] = {}  # engine request id -> sample; engine thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def num_handles(self) -> int:
        """Requests the engine thread still tracks (0 when idle: what leak tests assert)."""
        return len(self._handles)

    @property
    def samples_in_flight(self) -> int:
        return self._in_flight

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, request: SampleRequest) -> RequestHandle:
        """Queue `request`; raises `ServeError` (caller's thread) when it cannot be served."""
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise InvalidRequest("the prompt is empty: a completion needs at least one prompt token", "prompt")
        if request.n < 1:
            raise InvalidRequest(f"n must be at least 1 (got {request.n})", "n")
        if params.max_new_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1 (got {params.max_new_tokens})", "max_tokens")
        if request.constraint is not None and not self.engine.supports_constraints:
            raise InvalidRequest(
                f"this server's engine ({type(self.engine).__name__}) does not do constrained decoding: "
                "drop response_format / tool_choice required",
                "response_format",
            )
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ContextLengthExceeded(
                f"this model's context is {self.max_seq_len} tokens; the prompt has {len(prompt)} and max_tokens is "
                f"{params.max_new_tokens}: shorten the prompt or lower max_tokens",
                "prompt",
            )
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            if self._in_flight + request.n > self.max_samples:
                self.stats.rejected += 1
                raise QueueFull(f"{self._in_flight} samples are in flight (limit {self.max_samples}); retry shortly")
            self._in_flight += request.n
            self.stats.submitted += 1
        handle = RequestHandle(self, f"{request.source}-{next(self._ids)}", request)
        self._inbox.put(_Submit(handle))
        return handle

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Swap weights between two engine steps; later tokens carry `version` (returns at once)."""
        self._inbox.put(_Weights(state, version))

    def close(self) -> None:
        """Abort everything in flight and stop the engine thread."""
        with self._lock:
            self._closed = True
        self._inbox.put(_Close())
        self._thread.join()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            commands = [self._inbox.get()] if not self.engine.has_work else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            wakes: list = []
            if any(isinstance(c, _Close) for c in commands):
                return self._shutdown(commands, wakes)
            try:
                for command in commands:
                    self._apply(command, wakes)
                if self.engine.has_work:
                    self._publish(self.engine.step(), wakes)
            except Exception as exc:  # noqa: BLE001 -- every in-flight request learns why, the thread lives on
                self._fail_all(EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}"), wakes)
            _wake(wakes)

    def _shutdown(self, commands: list, wakes: list) -> None:
        """Fail everything in flight or still in the inbox with SchedulerClosed (HTTP 503)."""
        while True:  # submits that passed the closed check just before close() and came after it
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, _Submit):
                self._handles[command.handle.id] = command.handle
                with self._lock:
                    self._in_flight -= command.handle.request.n
        self._fail_all(SchedulerClosed("the server is shutting down"), wakes)
        _wake(wakes)

    def _apply(self, command, wakes: list) -> None:
        if isinstance(command, _Submit):
            handle, req = command.handle, command.handle.request
            self._handles[handle.id] = handle
            watch = req.stream or bool(req.stop)
            for j in range(req.n):
                rid = f"{handle.id}/{j}"
                self._live[rid] = _Live(handle, j, SampleText(self._decode, req.stop) if watch else None)
                fresh = Completion(
                    list(req.prompt_ids), [], [], [], "abort", "", rid, j, sample_seed(req.params.seed, j)
                )
                if req.constraint is None:
                    self.engine.resume([fresh], req.params, rid)
                else:
                    self.engine.resume([fresh], req.params, rid, constraints=[req.constraint()])
        elif isinstance(command, _Abort):
            self._abort(command.handle, wakes)
        elif isinstance(command, _Weights):
            self.engine.update_weights(command.state, command.version)

    def _abort(self, handle: RequestHandle, wakes: list) -> None:
        rids = [f"{handle.id}/{j}" for j in range(handle.request.n) if f"{handle.id}/{j}" in self._live]
        for c in self.engine.abort(rids):
            self._finish(c.request_id, c.token_ids, c.logprobs, c.versions, "abort", wakes, c.text)
        self.stats.aborted_samples += len(rids)

    def _publish(self, finished: list[Completion], wakes: list) -> None:
        stopped, sources = [], set()
        for sample in self.engine.running_samples():
            live = self._live.get(sample.request_id)
            if live is None:
                continue
            sources.add(live.handle.request.source)
            if live.text is not None and len(sample.token_ids) > live.sent:
                if self._advance(live, sample.token_ids, sample.logprobs, sample.versions, None, wakes):
                    stopped.append(sample.request_id)
        for c in finished:
            if (live := self._live.get(c.request_id)) is not None:
                sources.add(live.handle.request.source)
                self._finish(c.request_id, c.token_ids, c.logprobs, c.versions, c.finish_reason, wakes, c.text)
        for c in self.engine.abort(stopped):  # a stop string ended them: they leave the batch now
            self._finish(c.request_id, c.token_ids, c.logprobs, c.versions, "stop", wakes)
        self.stats.steps += 1
        if sources:
            self.stats.batch_sources[frozenset(sources)] += 1

    def _advance(
        self,
        live: _Live,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
        finish: FinishReason | None,
        wakes: list,
        engine_text: str | None = None,
    ) -> bool:
        """Publish the tokens past `live.sent`; returns whether a stop string ended the sample."""
        new = slice(live.sent, len(tokens))
        live.sent = len(tokens)
        stopped = False
        if live.text is None:
            text = engine_text or ""
        else:
            text_ids = tokens[:-1] if finish == "stop" and not live.text.stopped else tokens
            text, stopped = live.text.add(text_ids)
            if finish == "length" and live.text.stopped:  # the last allowed token completed a stop string
                finish = "stop"
            if finish is not None or stopped:
                text += live.text.rest()
        self.stats.tokens += len(tokens[new])
        delta = SampleDelta(live.index, tokens[new], logprobs[new], versions[new], text, finish)
        if wake := live.handle._publish(delta):
            wakes.append(wake)
        return stopped

    def _finish(
        self,
        rid: str,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
        reason: FinishReason,
        wakes: list,
        engine_text: str | None = None,
    ) -> None:
        live = self._live.pop(rid)
        if live.text is not None and live.text.stopped:
            reason = "stop"
        self._advance(live, tokens, logprobs, versions, reason, wakes, engine_text)
        with self._lock:
            self._in_flight -= 1
        self.stats.finished_samples += 1
        if live.handle.done:
            self._handles.pop(live.handle.id, None)

    def _fail_all(self, error: ServeError, wakes: list) -> None:
        try:
            self.engine.abort(list(self._live))
        except Exception:  # noqa: BLE001 -- a broken engine: its slots are lost with it, the handles still learn why
            pass
        for handle in self._handles.values():
            if wake := handle._fail(error):
                wakes.append(wake)
        with self._lock:
            self._in_flight -= len(self._live)
        self._live.clear()
        self._handles.clear()


def _wake(wakes: list) -> None:
    """One call_soon_threadsafe per event loop for the whole step, not one per request."""
    by_loop: dict = {}
    for loop, event in wakes:
        by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # that loop has closed: nobody waits there any more
            pass
    wakes.clear()


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
