"""The vLLM backend behind the same stepped-generator surface as `TorchEngine` (GPU users).

vLLM is imported lazily, so this module costs nothing where vLLM is absent. The engine core runs
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so weights are pushed by reference: each
worker's model gets `load_weights(state.items())`, vLLM's own loader that maps HF names onto its
fused q/k/v and gate/up parameters. Every sample is its own vLLM request (`<request>/<index>`), so
one sample can be aborted or resumed alone; vLLM's prefix cache shares a group's prompt.
Log-probs are requested in `processed_logprobs` mode: after temperature and top-k/top-p, i.e.
under the distribution actually sampled from, as `TorchEngine` records them.

It implements the whole `SteppedGenerator` protocol (`num_running`, `num_waiting`, `running`,
`max_seq_len`, `running_samples` included) and is covered by the generator contract test under
`-m gpu`. One `VLLMEngine` per process: vLLM sizes its KV cache from the GPU memory it finds, and
a second engine in one process would fight the first for it (the constructor refuses).

Differences from `TorchEngine` to know about:
- a request's random stream is vLLM's per-request seed; a resumed sample is reseeded from
  (seed, tokens so far), so a resumed run is reproducible but differs from an uninterrupted one;
- prefix caching and in-flight swaps: with the prefix cache on, a swap while samples are in
  flight aborts them, loads the weights, resets the prefix cache (now that no block is in use)
  and resubmits them with their tokens as prompt, so every cached block after a swap was computed
  by the new weights (the swap always recomputes KV). With `prefix_caching=False` the KV of
  in-flight samples is kept across a swap unless `recompute_kv`;
- `running` / `num_running`: vLLM schedules first come first served, so the running samples are
  taken to be the first `max_batch` live ones in submission order (vLLM's scheduler is not read);
- bf16 on GPU: its log-probs match the trainer's only up to bf16 rounding.
Verified only against vLLM's documented API, not on a GPU in this repository's CI.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from gapless.generate.protocol import RunningSample
from gapless.generate.sampling import sample_seed
from gapless.types import Completion, FinishReason, SamplingParams


@dataclass
class _Sample:
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


def _load_weights(worker, items) -> None:
    worker.model_runner.model.load_weights(weights=iter(items))


_ENGINE_IN_PROCESS = threading.Lock()  # held for the life of the process by the first engine


class VLLMEngine:
    def __init__(self, model_path: str, eos_id: int, decode: Callable[[list[int]], str] | None = None, *,
                 max_batch: int = 256, max_seq_len: int | None = None, dtype: str = "auto", gpu_memory_utilization: float = 0.5,
                 prefix_caching: bool = True, recompute_kv: bool = False, stop_ids: Iterable[int] = (), **engine_kwargs):
        if not _ENGINE_IN_PROCESS.acquire(blocking=False):
            raise RuntimeError("a VLLMEngine already runs in this process (vLLM sizes its cache from the free GPU memory); "
                               "use one engine per process, e.g. one generator actor each")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # weights by reference, not pickled
        import vllm

        self._vllm = vllm
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, max_num_seqs=max_batch, max_model_len=max_seq_len,
                            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=prefix_caching,
                            logprobs_mode="processed_logprobs", **engine_kwargs)
        self.engine = self.llm.llm_engine
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids)  # besides eos: e.g. a chat template's end-of-turn token
        self.max_batch = max_batch
        self.max_seq_len = int(max_seq_len or self.llm.llm_engine.model_config.max_model_len)
        self.prefix_caching = prefix_caching
        self.recompute_kv = recompute_kv
        self.version = 0
        self._decode_text = decode
        self._live: dict[str, _Sample] = {}  # vLLM request id -> sample
        self._ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def running(self) -> list[_Sample]:
        return list(itertools.islice(self._live.values(), self.max_batch))

    @property
    def num_running(self) -> int:
        return min(len(self._live), self.max_batch)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._live) - self.max_batch)

    def running_samples(self) -> Iterator[RunningSample]:
        return (RunningSample(s.request_id, s.index, s.tokens, s.logprobs, s.versions) for s in self.running)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        for j in range(n):
            self._submit(_Sample(request_id, j, sample_seed(params.seed, j), list(prompt_ids), params))
        return request_id

    def resume(self, partials: Iterable[Completion], params: SamplingParams, request_id: str | None = None) -> str:
        partials = list(partials)
        request_id = request_id if request_id is not None else (partials[0].request_id if partials else f"req-{next(self._ids)}")
        for c in partials:
            self._submit(_Sample(request_id, c.index, c.seed, list(c.prompt_ids), params,
                                 list(c.token_ids), list(c.logprobs), list(c.versions)))
        return request_id

    def _submit(self, sample: _Sample) -> None:
        p = sample.params
        left = p.max_new_tokens - len(sample.tokens)
        if left <= 0:
            raise ValueError(f"sample {sample.key} has no tokens left to generate")
        vp = self._vllm.SamplingParams(
            n=1, max_tokens=left, logprobs=0, seed=(sample.seed + len(sample.tokens)) % (1 << 63),
            temperature=0.0 if p.greedy else p.temperature, top_p=1.0 if p.greedy else p.top_p,
            top_k=p.top_k if p.top_k > 0 and not p.greedy else -1,  # -1: off in every vLLM version
            stop_token_ids=sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.stop_ids)), ignore_eos=p.ignore_eos, detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA, **_adjust_kwargs(p),
        )
        self.engine.add_request(sample.key, {"prompt_token_ids": sample.prompt + sample.tokens}, vp)
        self._live[sample.key] = sample

    def step(self) -> list[Completion]:
        finished = []
        for out in self.engine.step():
            sample = self._live.get(out.request_id)
            if sample is None:
                continue
            res = out.outputs[0]
            for token, lp in zip(res.token_ids, res.logprobs or []):
                sample.tokens.append(int(token))
                sample.logprobs.append(float(lp[token].logprob))
                sample.versions.append(self.version)
            if out.finished:
                del self._live[out.request_id]
                finished.append(self._completion(sample, "stop" if res.finish_reason == "stop" else "length"))
        return finished

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        ids = set(request_ids)
        keys = [k for k, s in self._live.items() if s.request_id in ids]
        self.engine.abort_request(keys)
        return sorted((self._completion(self._live.pop(k), "abort") for k in keys), key=lambda c: (c.request_id, c.index))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.has_work:
            raise RuntimeError("generate() needs an idle engine; with requests in flight drive add_request/step instead")
        request_id = f"generate-{next(self._ids)}"
        for i, prompt in enumerate(prompts):
            self._submit(_Sample(request_id, i, sample_seed(params.seed, i), list(prompt), params))
        done: dict[int, Completion] = {}
        while self.has_work:
            done.update((c.index, c) for c in self.step())
        return [done[i] for i in range(len(prompts))]

    def update_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool | None = None) -> None:
        """Load new weights between steps. With the prefix cache on, in-flight samples are taken
        out first and resubmitted after the cache reset (see the module docstring)."""
        recompute = self.prefix_caching or (self.recompute_kv if recompute_kv is None else recompute_kv)
        partials = list(self._live.values()) if recompute else []
        if partials:
            self.engine.abort_request(list(self._live))
            self._live.clear()
        self.llm.collective_rpc(_load_weights, args=(list(state.items()),))
        if self.prefix_caching and self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight push (blocks still in use); "
                               "build VLLMEngine(prefix_caching=False) and report this")
        self.version = version
        for sample in partials:  # re-prefilled by the new weights; tokens, log-probs and versions kept
            self._submit(sample)

    def _completion(self, s: _Sample, reason: FinishReason) -> Completion:
        text_ids = s.tokens[:-1] if reason == "stop" else s.tokens
        text = self._decode_text(text_ids) if self._decode_text else ""
        return Completion(list(s.prompt), list(s.tokens), list(s.logprobs), list(s.versions), reason, text, s.request_id, s.index, s.seed)


def _adjust_kwargs(p: SamplingParams) -> dict:
    """vLLM's own names for a request's logit bias and penalties (types.LogitAdjustment)."""
    if p.adjust is None or p.adjust.is_identity:
        return {}
    a = p.adjust
    return {"presence_penalty": a.presence_penalty, "frequency_penalty": a.frequency_penalty,
            "repetition_penalty": a.repetition_penalty, "logit_bias": dict(a.logit_bias) or None}
