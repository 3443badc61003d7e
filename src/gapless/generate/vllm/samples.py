"""The sample bookkeeping both vLLM engines share (vllm/engine.py in this process, vllm/remote.py
over a `vllm serve` server): one vLLM request per sample (`<request>/<index>`), the live samples in
submission order, the first `max_batch` of them counted as running, and an ended sample made a
`Completion`.

A subclass provides `_submit(sample)` (hand the sample to vLLM and record it in `_live`), `step()`,
`has_work`, and the attributes `max_batch`, `max_seq_len`, `_live`, `_ids`, `_lock` (held around every change of
`_live`) and `_decode_text`. Not guaranteed: which samples vLLM actually runs; `running` assumes
first come first served.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from gapless.generate.protocol import RunningSample
from gapless.generate.sampling import sample_seed
from gapless.types import Completion, FinishReason, SamplingParams


@dataclass
class Sample:
    request_id: str
    index: int
    seed: int
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.request_id}/{self.index}"


class SampleBook:
    sample_type: type[Sample] = Sample

    @property
    def running(self) -> list[Sample]:
        return list(itertools.islice(self._live.values(), self.max_batch))

    @property
    def num_running(self) -> int:
        return min(len(self._live), self.max_batch)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._live) - self.max_batch)

    def running_samples(self) -> Iterator[RunningSample]:
        return (RunningSample(s.request_id, s.index, s.tokens, s.logprobs, s.versions) for s in self.running)

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        with self._lock:
            for j in range(n):
                self._submit(self.sample_type(request_id, j, sample_seed(params.seed, j), list(prompt_ids), params))
        return request_id

    def resume(self, partials: Iterable[Completion], params: SamplingParams, request_id: str | None = None) -> str:
        """Continue cut samples where they stopped: their tokens, log-probs and versions kept."""
        partials = list(partials)
        request_id = (
            request_id if request_id is not None else (partials[0].request_id if partials else f"req-{next(self._ids)}")
        )
        with self._lock:
            for c in partials:
                sample = self.sample_type(request_id, c.index, c.seed, list(c.prompt_ids), params)
                sample.tokens, sample.logprobs, sample.versions = list(c.token_ids), list(c.logprobs), list(c.versions)
                self._submit(sample)
        return request_id

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run `prompts` to completion (sample i draws from stream (params.seed, i)); returns in order."""
        if self.has_work:
            raise RuntimeError(
                "generate() needs an idle engine; with requests in flight drive add_request/step instead"
            )
        request_id = f"generate-{next(self._ids)}"
        with self._lock:
            for i, prompt in enumerate(prompts):
                self._submit(self.sample_type(request_id, i, sample_seed(params.seed, i), list(prompt), params))
        done: dict[int, Completion] = {}
        while self.has_work:
            done.update((c.index, c) for c in self.step())
        return [done[i] for i in range(len(prompts))]

    def _room(self, sample: Sample) -> int:
        """How many tokens the sample may still generate: what `max_new_tokens` leaves, within
        `max_seq_len`; a ValueError where nothing is left."""
        left = sample.params.max_new_tokens - len(sample.tokens)
        if left <= 0:
            raise ValueError(f"sample {sample.key} has no tokens left to generate")
        context = len(sample.prompt) + len(sample.tokens)
        if context >= self.max_seq_len:
            raise ValueError(
                f"sample {sample.key}: {context} context tokens leave no room under max_seq_len = {self.max_seq_len}"
            )
        return min(left, self.max_seq_len - context)

    def _completion(self, s: Sample, reason: FinishReason) -> Completion:
        text_ids = s.tokens[:-1] if reason == "stop" else s.tokens
        text = self._decode_text(text_ids) if self._decode_text else ""
        return Completion(
            list(s.prompt),
            list(s.tokens),
            list(s.logprobs),
            list(s.versions),
            reason,
            text,
            s.request_id,
            s.index,
            s.seed,
        )
