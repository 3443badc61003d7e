"""A stepped generator over a `vllm serve` process: generation through its OpenAI completions API,
weights through its HTTP routes (vllm/http_push.py).

Every sample is one streamed `POST /v1/completions` request (vllm/completions.py): the prompt as
token ids, its own seed, token ids and sampled log-probs back (under `--logprobs-mode
processed_logprobs`: after temperature and top-k/top-p, as every gapless engine records them),
so one sample can be aborted or resumed alone. A push never overlaps a
request of this engine: `update_weights` takes every sample out (the tokens received so far are
kept), pushes (the server pauses, reloads, resumes), and resubmits each sample with its tokens
appended to its prompt, reseeded from (seed, tokens so far). So a request runs under one set of
weights from its first token to its last, and every token records the version that was current
when its request was sent. Concurrency:

    caller thread (step / abort / update_weights, one lock)      event-loop thread
      submit ─── run_coroutine_threadsafe ───────────────────────► stream(): POST, read chunks
      step() ◄── queue of (sample, submission, chunk) ◄────────── put(chunk) per SSE event
    A taken-out sample's submission number moves on, so chunks still in the queue from its old
    request are dropped, never recorded.

A request the server ends as `abort` that this engine did not abort (another client's `/pause`)
is resubmitted the same way. Guaranteed: the `SteppedGenerator` surface (generate/protocol.py);
per-token versions exact as above; a failed request (an HTTP error, a server gone) raises in
`step()`, and so does a server that sends nothing for `NO_PROGRESS_S` while requests are in flight
(wedged). Not guaranteed: `step()` advances by whatever the server produced meanwhile (up to
`STEP_WAIT_S` of waiting for the first chunk), not one token per sample; `running` takes the first
`max_batch` live samples in submission order to be the running ones (the server's scheduler is
not read); a resumed sample differs from an uninterrupted one (reseeded); no LoRA, no
grammar-constrained decoding. Two engines must not share one server: the other's pushes would
change the weights under this one's requests (config/checks.py refuses it).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gapless.faults import fault_point, process_role
from gapless.generate.vllm.completions import Chunk, make_client, request_body, stream
from gapless.generate.vllm.http_push import HTTPReload
from gapless.generate.vllm.samples import Sample, SampleBook
from gapless.generate.vllm.server import VLLMServer
from gapless.types import Completion

STEP_WAIT_S = 0.05  # longest a step waits for the server's next chunk
NO_PROGRESS_S = 600.0  # requests in flight and not one chunk for this long: the server is wedged


@dataclass
class _Sample(Sample):
    submission: int = 0  # bumped whenever the sample is taken out: older requests' chunks are stale
    version: int = 0  # the version its current request runs under
    future: object = None  # the concurrent.futures.Future of its request


class VLLMServerEngine(SampleBook):
    sample_type = _Sample

    supports_constraints = False

    def __init__(
        self,
        server: VLLMServer,
        eos_id: int,
        decode=None,
        *,
        weights_dir,
        max_batch: int,
        max_seq_len: int,
        stop_ids=(),
        no_progress_s: float = NO_PROGRESS_S,
    ):
        self.server = server
        self.weights = HTTPReload(server.url, weights_dir)
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids)
        self.max_batch = max_batch
        self.max_seq_len = int(max_seq_len)
        self.version = 0
        self.no_progress_s = no_progress_s
        self._progress_at = time.monotonic()  # the last chunk received (or request sent)
        self._decode_text = decode
        self._live: dict[str, _Sample] = {}
        self._finished: list[Completion] = []  # finished while a push or an abort drained the queue
        self._chunks: queue.Queue[Chunk] = queue.Queue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-server-client", daemon=True)
        self._thread.start()
        self._client = self._call(make_client(max_batch + 8))

    # -- the stepped surface -------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._live) or bool(self._finished)

    def step(self) -> list[Completion]:
        with self._lock:
            fault_point(process_role(), "vllm_step")  # the fault tests' wedge or error of a real step
            if not self._finished and self._live:
                try:
                    self._apply(self._chunks.get(timeout=STEP_WAIT_S))
                except queue.Empty:
                    pass
            self._drain()
            finished, self._finished = self._finished, []
            if self._live and time.monotonic() - self._progress_at > self.no_progress_s:
                raise RuntimeError(
                    f"vLLM server {self.server.url}: no token in {self.no_progress_s:.0f} s with {len(self._live)} "
                    f"requests in flight (wedged); its log ends:\n{self.server.log_tail()}"
                )
        return finished

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        ids = set(request_ids)
        with self._lock:
            self._drain()
            keys = [k for k, s in self._live.items() if s.request_id in ids]
            out = []
            for k in keys:
                sample = self._live.pop(k)
                self._take_out(sample)
                out.append(self._completion(sample, "abort"))
            return sorted(out, key=lambda c: (c.request_id, c.index))

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Take every sample out, push (the server pauses, reloads, resumes), resubmit them."""
        with self._lock:
            self._drain()
            partials = list(self._live.values())
            for sample in partials:
                self._take_out(sample)
            self.weights.push(state, version)
            self.version = version
            for sample in partials:
                self._submit(sample)

    def close(self) -> None:
        """Stop the requests, the client's thread and a server this process started (idempotent)."""
        if not self._thread.is_alive():
            return
        with self._lock:
            for sample in self._live.values():
                self._take_out(sample)
            self._live.clear()
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.server.close()

    # -- requests and chunks -------------------------------------------------------------------

    def _submit(self, sample: _Sample) -> None:
        p = sample.params
        room = self._room(sample)
        prompt, seed = sample.prompt + sample.tokens, (sample.seed + len(sample.tokens)) % (1 << 63)
        body = request_body(self.server.model, prompt, p, room, seed, self.stop_ids)
        sample.version = self.version
        if not self._live:
            self._progress_at = time.monotonic()  # an idle engine's clock starts with its first request
        self._live[sample.key] = sample
        chunks, url = self._chunks, self.server.url + "/v1/completions"
        sample.future = asyncio.run_coroutine_threadsafe(
            stream(self._client, url, body, sample, sample.submission, chunks), self._loop
        )

    def _take_out(self, sample: _Sample) -> None:
        sample.submission += 1  # its request's chunks still queued are stale from here on
        if sample.future is not None:
            sample.future.cancel()  # closes the stream; the server aborts a request whose client left
            sample.future = None

    def _drain(self) -> None:
        while True:
            try:
                self._apply(self._chunks.get_nowait())
            except queue.Empty:
                return

    def _apply(self, chunk: Chunk) -> None:
        sample = chunk.sample
        self._progress_at = time.monotonic()
        if self._live.get(sample.key) is not sample or chunk.submission != sample.submission:
            return  # from a request taken out since
        if chunk.error is not None:
            raise RuntimeError(f"vLLM server request {sample.key} failed: {chunk.error}")
        for token, lp in zip(chunk.token_ids, chunk.logprobs, strict=True):
            sample.tokens.append(int(token))
            sample.logprobs.append(float(lp))
            sample.versions.append(sample.version)
        if chunk.finish in ("stop", "length"):
            del self._live[sample.key]
            sample.future = None
            self._finished.append(self._completion(sample, chunk.finish))
        elif chunk.end:  # ended by someone else (another client's pause): continue it
            self._take_out(sample)
            self._submit(sample)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
