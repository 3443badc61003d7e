"""The generator seam: what the loop (and later the async pipeline) may ask of any engine.

`Generator` is all the synchronous loop needs: run a batch of prompts to completion, take new
weights, report the policy version it samples with. `SteppedGenerator` adds the step-level
surface the asynchronous pipeline drives: queue groups, advance one decode step at a time, swap
weights between steps, abort stragglers and resume them later. Implementations: `TorchSampler`
(the simple reference, `Generator` only), `TorchEngine`, `VLLMEngine` and `VLLMServerEngine` (a
`vllm serve` process over HTTP; stepped, though a step advances by what the server streamed).
`StreamingGenerator` adds what the serving scheduler (`gapless.serve`) reads: the tokens each
running sequence holds so far, so a stream can publish them step by step, and whether the engine
decodes under a grammar. `TorchEngine` and `VLLMEngine` are both streaming, so one scheduler
drives either (`gapless serve` and the Tinker service's samplers).
Every attribute a caller touches is declared here, and `tests/unit/test_generator_contract.py`
runs one contract over every implementation (the vLLM one under `-m gpu`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from gapless.types import Completion, SamplingParams


@runtime_checkable
class Generator(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions in the order of `prompts`; every token records `version`."""
        ...

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a full HF-named state dict (in a LoRA run: the adapter tensors, which the torch
        engines merge into their base, generate/adapters.py); tokens sampled afterwards carry `version`."""
        ...


class InFlight(Protocol):
    """A sample the engine holds between steps (read only: the lists are the engine's own)."""

    request_id: str
    index: int
    tokens: list[int]


@runtime_checkable
class SteppedGenerator(Generator, Protocol):
    max_seq_len: int

    @property
    def has_work(self) -> bool: ...

    @property
    def num_running(self) -> int:
        """Samples decoding in this step (the pipeline's token count and report)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Samples queued for a slot."""
        ...

    @property
    def running(self) -> Sequence[InFlight]:
        """The running samples in slot order (partial-rollout cuts read their request ids and tokens)."""
        ...

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> str:
        """Queue a group of `n` samples of one prompt; returns its request id."""
        ...

    def resume(self, partials: Iterable[Completion], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue aborted completions to continue where they stopped."""
        ...

    def step(self) -> list[Completion]:
        """Advance every running sequence by one token; return those that finished."""
        ...

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Cancel the unfinished samples of these requests; return them as partial completions."""
        ...


class RunningSample(NamedTuple):
    """One running sequence between steps: its lists are the engine's own (read, never keep or mutate)."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@runtime_checkable
class StreamingGenerator(SteppedGenerator, Protocol):
    supports_constraints: bool  # `resume(..., constraints=)`: grammar-constrained decoding

    def running_samples(self) -> Iterable[RunningSample]:
        """Every sequence in a running slot, with the tokens sampled so far (valid until the next step)."""
        ...
