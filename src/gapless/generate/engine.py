"""The torch generator engine: continuous batching over a slot KV cache, with in-flight weight swaps.

Who calls what (one thread; the caller drives the steps and swaps weights between them):

    add_request / resume ──> waiting queue ──(free slots)──> prefill ──> running slots 0..B-1
                                                                              │
    finished completions <── step(): decode one token per running slot <──────┘
    abort(ids) ──> partial completions (finish reason "abort"), resumable later
    update_weights(state, v) between steps: KV kept, or in-flight sequences re-prefilled
                             (a LoRA run pushes adapters only: merged into the base, adapters.py)

A step (1) fills the free slots from the waiting queue: the keys/values of each newcomer's
context but its last token are prefilled in one batch, each distinct prefix once --
the N samples of a group share one prompt prefill, and a stashed copy serves samples admitted in
later steps; with a prefix cache (`prefix_cache_mb`, prefix_cache.py) only the tokens past the
longest cached prefix are prefilled, and prompts and finished contexts are kept for later
requests, under the current weights only (every weight change clears it); (2) decodes one token for every running sequence in one batched forward (a newcomer
feeds its last context token, so every token is sampled in the same place); (3) retires the
finished sequences and closes the holes by moving the last slots down, so the running batch is
always the prefix 0..B-1 of the cache and a freed slot is refilled at the next step.
The decode forward runs on `decode_rows(B)` >= B slots, a few sizes per power of two: the free
slots past B ride along at position 0 (their outputs are dropped, and a slot's cache is rewritten
from position 0 when a sequence takes it). oneDNN compiles and caches one kernel per linear layer
per row count; without the rounding a run whose batch takes every size from 1 to max_batch holds
hundreds of them (measured: +330 MB of resident memory over 24 batches of 128 with early stops).

Guarantees (tested): greedy tokens equal `transformers` `generate`; cached decoding equals full
recomputation within fp32 rounding; with top-p = 1 and top-k = 0 each token's log-prob equals the
trainer's `token_logprobs` at the same weights and temperature; every token records the policy
version of the weights whose forward pass produced its logits. A sequence's random numbers come
from its own stream (request seed, sample index), so a rerun with the same requests in the same
order gives identical tokens; a different batch composition changes only float rounding.
A sequence resumed with a `TokenConstraint` (generate/constraint.py) samples only the tokens its
grammar allows: its row's other logits are set to -inf before sampling, other rows untouched.
After a swap with the KV kept, the next tokens attend to keys/values computed by the old weights
(as PipelineRL does); with `recompute_kv` the whole context is re-prefilled by the new weights.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from gapless.generate.adapters import AdapterMerge
from gapless.generate.constraint import TokenConstraint, bitmask_words, mask_logits
from gapless.generate.families import engine_path
from gapless.generate.hf_runner import HFRunner
from gapless.generate.logit_adjust import apply_adjustments
from gapless.generate.prefix_cache import PrefixCache, PrefixCacheStats
from gapless.generate.protocol import RunningSample
from gapless.generate.runner import DecoderRunner, attention_ranges
from gapless.generate.sampling import RowSettings, sample_rows, sample_seed, uniform_stream
from gapless.types import Completion, FinishReason, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    request_id: str
    index: int
    seed: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    constraint: TokenConstraint | None = None  # grammar-constrained decoding (generate/constraint.py)
    weights: int = -1  # the engine's weight epoch when its keys/values were prefilled

    @property
    def context(self) -> tuple[int, ...]:
        return tuple(self.prompt + self.tokens)

    def finish_reason(self) -> FinishReason | None:
        if self.tokens and self.tokens[-1] in self.stop_ids:
            return "stop"
        if self.constraint is not None and self.constraint.is_terminated:
            return "stop"
        if len(self.tokens) >= self.params.max_new_tokens:
            return "length"
        return None


@dataclass
class EngineStats:
    """Work done since creation: what the benchmark turns into FLOP/s."""

    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0  # context tokens run through a prefill
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)  # hits, misses, reused tokens


class _Slots:
    """Per-slot decode state as tensors, so a decode step builds no per-row Python objects."""

    def __init__(self, slots: int, width: int, device: torch.device):
        like = dict(device=device)
        self.position = torch.zeros(slots, dtype=torch.long, **like)  # KV length = position of the next fed token
        self.last_token = torch.zeros(slots, dtype=torch.long, **like)
        self.generated = torch.zeros(slots, dtype=torch.long, **like)  # index into the uniform stream
        self.temperature = torch.ones(slots, **like)
        self.top_p = torch.ones(slots, **like)
        self.top_k = torch.zeros(slots, dtype=torch.long, **like)
        self.greedy = torch.zeros(slots, dtype=torch.bool, **like)
        self.uniforms = torch.zeros(slots, width, **like)
        self._all = [
            self.position,
            self.last_token,
            self.generated,
            self.temperature,
            self.top_p,
            self.top_k,
            self.greedy,
            self.uniforms,
        ]

    def assign(self, lo: int, seqs: list[_Sequence], last_tokens: list[int], positions: list[int]) -> None:
        """Set slots lo, lo+1, ... for `seqs` (one tensor write per field, not per sequence)."""
        hi, params = lo + len(seqs), [s.params for s in seqs]
        put = lambda field, values, **kw: field[lo:hi].copy_(torch.tensor(values, **kw))  # noqa: E731
        put(self.position, positions)
        put(self.last_token, last_tokens)
        put(self.generated, [len(s.tokens) for s in seqs])
        put(self.temperature, [1.0 if p.greedy else p.temperature for p in params], dtype=self.temperature.dtype)
        put(self.top_p, [1.0 if p.greedy else p.top_p for p in params], dtype=self.top_p.dtype)
        put(self.top_k, [0 if p.greedy else p.top_k for p in params])
        put(self.greedy, [p.greedy for p in params])
        for i, seq in enumerate(seqs):
            self.uniforms[lo + i, : seq.params.max_new_tokens] = uniform_stream(seq.seed, seq.params.max_new_tokens)

    def move(self, src: list[int], dst: list[int]) -> None:
        src_t, dst_t = torch.tensor(src), torch.tensor(dst)
        for t in self._all:
            t[dst_t] = t[src_t]

    def free(self, lo: int, hi: int) -> None:
        """Slots lo..hi-1 left the batch: park them at position 0 (where a padded decode writes)."""
        self.position[lo:hi] = 0
        self.last_token[lo:hi] = 0

    def settings(self, seqs: list[_Sequence]) -> RowSettings:
        """Sampling settings of slots 0..len(seqs)-1, which `seqs` occupy."""
        greedy, n = [s.params.greedy for s in seqs], len(seqs)
        return RowSettings(
            self.temperature[:n],
            self.top_p[:n],
            self.top_k[:n],
            self.greedy[:n],
            any_truncation=any(not s.params.greedy and (s.params.top_p < 1.0 or s.params.top_k > 0) for s in seqs),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
        )


class TorchEngine:
    """Generator over a copy of an HF causal LM's weights; push new ones with `update_weights`.

    `path` says which runner serves it (`families.engine_path`, logged once at creation): 'lean'
    (`DecoderRunner`, the families it implements) or 'generic' (`HFRunner`, any other model)."""

    def __init__(
        self,
        model: torch.nn.Module,
        eos_id: int,
        decode: Callable[[list[int]], str] | None = None,
        *,
        max_batch: int = 64,
        max_seq_len: int | None = None,
        recompute_kv: bool = False,
        kernels: str = "auto",
        stop_ids: Iterable[int] = (),
        path: str = "auto",
        prefix_cache_mb: int = 0,
    ):
        """`path`: 'auto' (the family decides) or 'generic' (force the HF-module runner).
        `prefix_cache_mb`: memory for keys/values kept across requests (prefix_cache.py); 0 = off.
        The lean runner only: the generic path keeps no prefix cache."""
        self.path, notice = (
            engine_path(model.config) if path == "auto" else ("generic", "engine: generic path (requested)")
        )
        logger.info(notice)
        runner_class = DecoderRunner if self.path == "lean" else HFRunner
        self.runner = runner_class(model, max_seq_len or model.config.max_position_embeddings, kernels)
        self.max_batch = max_batch
        self.max_seq_len = self.runner.max_seq_len
        self.cache = self.runner.new_cache(0)  # grown by _reserve as the batch grows (kv_cache.py)
        self.slots = _Slots(max_batch, self.max_seq_len, self.runner.device)
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids)  # besides eos: e.g. a chat template's end-of-turn tokens
        self.recompute_kv = recompute_kv
        self.version = 0
        self.adapters: AdapterMerge | None = None  # set for a LoRA run (make_generator): pushes are adapters
        self.stats = EngineStats()
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 and self.path == "lean" else None
        if self.prefix_cache is not None:
            self.stats.prefix_cache = self.prefix_cache.stats
        self._weights = 0  # bumped by every weight change: a sequence prefilled before one is not cached
        self.running: list[_Sequence] = []  # running[i] occupies slot i
        self.waiting: deque[_Sequence] = deque()
        self._decode_text = decode
        self._prefixes: dict[tuple[int, ...], object] = {}  # prefix -> its stashed prefill (the runner's stash_row)
        self._waiting_prefixes: Counter[tuple[int, ...]] = Counter()
        self._decode_rows: RowSettings | None = None  # settings of the running batch, rebuilt when it changes
        self._adjusted: list[int] = []  # running rows with a logit adjustment, rebuilt with _decode_rows
        self._attention_ranges: list[tuple[int, int]] = []  # the runner's attention split, rebuilt with _decode_rows
        self._ids = itertools.count()
        self._bitmask: torch.Tensor | None = None  # (max_batch, ceil(V / 32)) int32, constrained rows' masks

    # ---- requests -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def running_samples(self) -> Iterator[RunningSample]:
        """The running sequences' tokens so far, as views of the engine's own lists (StreamingGenerator)."""
        return (RunningSample(s.request_id, s.index, s.tokens, s.logprobs, s.versions) for s in self.running)

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> str:
        """Queue `n` samples of one prompt (a group); sample j draws from stream (params.seed, j)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        for j in range(n):
            self._enqueue(
                _Sequence(request_id, j, sample_seed(params.seed, j), list(prompt_ids), params, self._stops(params))
            )
        return request_id

    supports_constraints = True  # `resume(..., constraints=)`: grammar-constrained decoding

    def resume(
        self,
        partials: Iterable[Completion],
        params: SamplingParams,
        request_id: str | None = None,
        constraints: Sequence[TokenConstraint | None] | None = None,
    ) -> str:
        """Continue aborted completions (possibly under newer weights): each keeps its tokens,
        log-probs, versions and random stream; `params.max_new_tokens` counts all their tokens.
        `constraints[i]` (optional) constrains partial i's next tokens; it must already have
        accepted that partial's tokens."""
        partials = list(partials)
        constraints = list(constraints) if constraints is not None else [None] * len(partials)
        request_id = (
            request_id if request_id is not None else (partials[0].request_id if partials else f"req-{next(self._ids)}")
        )
        for c, constraint in zip(partials, constraints, strict=True):
            seq = _Sequence(
                request_id,
                c.index,
                c.seed,
                list(c.prompt_ids),
                params,
                self._stops(params),
                list(c.token_ids),
                list(c.logprobs),
                list(c.versions),
                constraint,
            )
            if (reason := seq.finish_reason()) is not None:
                raise ValueError(
                    f"completion {c.request_id}/{c.index} is already finished ({reason}); only partial ones resume"
                )
            self._enqueue(seq)
        return request_id

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Cancel every unfinished sample of these requests; return them as partial completions."""
        ids = set(request_ids)
        out = self._retire([i for i, seq in enumerate(self.running) if seq.request_id in ids], "abort")
        kept: deque[_Sequence] = deque()
        for seq in self.waiting:
            if seq.request_id in ids:
                out.append(self._completion(seq, "abort"))
                self._leave_waiting(seq.context[:-1])
            else:
                kept.append(seq)
        self.waiting = kept
        return sorted(out, key=lambda c: (c.request_id, c.index))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run `prompts` to completion (sequence i draws from stream (params.seed, i)); returns in order."""
        if self.has_work:
            raise RuntimeError(
                "generate() needs an idle engine; with requests in flight drive add_request/step instead"
            )
        request_id = f"generate-{next(self._ids)}"
        stops = self._stops(params)
        for i, prompt in enumerate(prompts):
            self._enqueue(_Sequence(request_id, i, sample_seed(params.seed, i), list(prompt), params, stops))
        done: dict[int, Completion] = {}
        while self.has_work:
            done.update((c.index, c) for c in self.step())
        return [done[i] for i in range(len(prompts))]

    def _stops(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else {self.eos_id} | self.stop_ids)

    def _enqueue(self, seq: _Sequence) -> None:
        if not seq.prompt:
            raise ValueError("empty prompt: a completion needs at least one context token")
        if len(seq.prompt) + seq.params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(seq.prompt)}) + max_new_tokens ({seq.params.max_new_tokens}) exceeds the "
                f"engine's max_seq_len ({self.max_seq_len}); shorten them or build the engine with a larger max_seq_len"
            )
        self.waiting.append(seq)
        self._waiting_prefixes[seq.context[:-1]] += 1

    def _leave_waiting(self, prefix: tuple[int, ...]) -> None:
        self._waiting_prefixes[prefix] -= 1
        if self._waiting_prefixes[prefix] == 0:
            del self._waiting_prefixes[prefix]
            self._prefixes.pop(prefix, None)

    # ---- weights --------------------------------------------------------------------------
    def update_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool | None = None) -> None:
        """Swap weights between steps; in-flight sequences continue and their next tokens carry
        `version`. With `recompute_kv` (default: the engine's setting) their caches are rebuilt
        by the new weights at the next step instead of kept."""
        if self.adapters is not None:  # a LoRA run's push: adapter tensors, merged into the base
            self.adapters.load(state, lambda merged: self.runner.load_state(merged, partial=True))
        else:
            self.runner.load_state(state)
        self.version = version
        self._weights += 1
        self._prefixes.clear()  # stashed prefills belong to the old weights
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # and so does every cached prefix
        if self.recompute_kv if recompute_kv is None else recompute_kv:
            for seq in reversed(self.running):
                self.waiting.appendleft(seq)
                self._waiting_prefixes[seq.context[:-1]] += 1
            self.slots.free(0, len(self.running))
            self.running.clear()
            self._decode_rows = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.runner.state_dict()

    # ---- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Completion]:
        """Fill free slots from the waiting queue, then decode one token for every running
        sequence; returns the completions that finished in this step."""
        self._admit()
        finished = self._decode_step() if self.running else []
        self.stats.steps += 1
        return finished

    def _decode_step(self) -> list[Completion]:
        batch, slots = len(self.running), self.slots
        rows = decode_rows(batch, self.max_batch) if self.runner.pads_rows else batch
        if self._decode_rows is None:  # the batch changed
            self._decode_rows = slots.settings(self.running)
            self._adjusted = [
                i for i, s in enumerate(self.running) if s.params.adjust and not s.params.adjust.is_identity
            ]
            if self.runner.native is None:  # the native kernels read each slot's own length
                self._attention_ranges = attention_ranges(slots.position[:rows].tolist())
        logits = self.runner.decode(slots.last_token[:rows], slots.position[:rows], self.cache, self._attention_ranges)[
            :batch
        ]  # (B, V)
        if self._adjusted:  # per-request bias and penalties (served requests), row by row
            logits = apply_adjustments(
                logits, [(i, (q := self.running[i]).params.adjust, q.prompt, q.tokens) for i in self._adjusted]
            )
        u = slots.uniforms[:batch].gather(1, slots.generated[:batch, None]).squeeze(1)  # (B,)
        native = self.runner.native
        if constrained := [i for i, seq in enumerate(self.running) if seq.constraint is not None]:
            logits = self._constrain(logits, constrained)
            native = None  # the native sampler's fast exp is not defined at -inf
        tokens, logprobs = sample_rows(logits, self._decode_rows, u, native)
        slots.position[:batch] += 1
        slots.last_token[:batch] = tokens
        slots.generated[:batch] += 1
        self.stats.decode_tokens += batch
        return self._record(tokens.tolist(), logprobs.tolist())

    def _constrain(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Mask the constrained rows' logits to their grammars' allowed tokens (other rows untouched)."""
        words = bitmask_words(logits.shape[-1])
        if self._bitmask is None or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros(self.max_batch, words, dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]
        for k, i in enumerate(rows):
            self.running[i].constraint.fill_bitmask(bitmask, k)
        logits = logits.float().clone()  # the runner may hand out a view of its own buffer
        mask_logits(logits, rows, bitmask)
        return logits

    def _admit(self) -> None:
        """Move waiting sequences into the free slots: the cache gets the keys/values of all but
        the last context token, which the next decode feeds like any sampled token."""
        take = min(self.max_batch - len(self.running), len(self.waiting))
        if take == 0:
            return
        seqs = [self.waiting.popleft() for _ in range(take)]
        contexts = [seq.context for seq in seqs]
        lo = len(self.running)
        self._reserve(lo + take)
        self._fill_slots([ctx[:-1] for ctx in contexts], lo)
        self.slots.assign(lo, seqs, [ctx[-1] for ctx in contexts], [len(ctx) - 1 for ctx in contexts])
        for seq, ctx in zip(seqs, contexts):
            self._leave_waiting(ctx[:-1])
            seq.weights = self._weights
        self.running += seqs
        self._decode_rows = None

    def _reserve(self, batch: int) -> None:
        """Grow the KV cache to hold `batch` sequences and the decode's padded rows: at least
        doubling, at most max_batch, so the cache is sized by the busiest batch so far."""
        rows = decode_rows(batch, self.max_batch) if self.runner.pads_rows else batch
        if rows > self.cache.slots:
            self.cache.reserve(min(self.max_batch, max(rows, 2 * self.cache.slots)))

    def _fill_slots(self, prefixes: list[tuple[int, ...]], lo: int) -> None:
        """Write the keys/values of `prefixes` into slots lo, lo+1, ... Each distinct prefix is
        prefilled once (or copied from its stash), past what the prefix cache holds of it; a fresh
        prefill is stashed while sequences with the same prefix still wait for a slot, and kept in
        the prefix cache."""
        fresh = list(dict.fromkeys(p for p in prefixes if p and p not in self._prefixes))  # distinct, in order
        hits = {p: hit for p in fresh if (hit := self._lookup(p)) is not None}
        for prefix in [p for p in fresh if p in hits and hits[p][1] == len(p)]:  # wholly cached: nothing to run
            self._prefixes[prefix] = hits[prefix][0]  # placed below like a stash; _leave_waiting drops it
            fresh.remove(prefix)
        if fresh:
            row = {prefix: i for i, prefix in enumerate(fresh)}
            past = [hits[p][0] if p in hits else None for p in fresh]
            kv = self.runner.prefill(fresh, past) if hits else self.runner.prefill(fresh)
            # lean: per layer (R, kv_heads, P, hd); generic: one HF cache per row
            self.stats.prefill_tokens += sum(len(p) - (hits[p][1] if p in hits else 0) for p in fresh)
            into = [(row[p], lo + i) for i, p in enumerate(prefixes) if p in row]
            self.runner.place(self.cache, kv, [r for r, _ in into], [s for _, s in into])
            admitted = Counter(prefixes)
            for prefix, r in row.items():
                waits = self._waiting_prefixes[prefix] > admitted[prefix]
                if waits or self.prefix_cache is not None:
                    stash = self.runner.stash_row(kv, r, len(prefix))  # a copy, never written to: shareable
                    if waits:
                        self._prefixes[prefix] = stash
                    if self.prefix_cache is not None:
                        self.prefix_cache.insert(prefix, stash)
        for prefix in dict.fromkeys(p for p in prefixes if p in self._prefixes and p not in fresh):
            slots = [lo + i for i, p in enumerate(prefixes) if p == prefix]
            self.runner.place(self.cache, self._prefixes[prefix], [0] * len(slots), slots)

    def _lookup(self, prefix: tuple[int, ...]):
        return self.prefix_cache.lookup(prefix) if self.prefix_cache is not None else None

    def _keep(self, seq: _Sequence, slot: int) -> None:
        """Put a finished sequence's keys/values (its context but the last token) in the prefix
        cache, if the current weights computed all of them: the next turn of a conversation
        starts with this context."""
        if self.prefix_cache is None or seq.weights != self._weights:
            return
        length = int(self.slots.position[slot])
        self.prefix_cache.insert(seq.context[:length], self.runner.stash_slot(self.cache, slot, length))

    def _record(self, tokens: list[int], logprobs: list[float]) -> list[Completion]:
        """Append one token to every running sequence; retire those that finished."""
        done, reasons = [], []
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            seq = self.running[i]
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            if (reason := seq.finish_reason()) is not None:
                done.append(i)
                reasons.append(reason)
        return self._retire(done, reasons)

    def _retire(self, done: list[int], reasons: list[FinishReason] | FinishReason) -> list[Completion]:
        """Remove running[i] for i in `done` and move the last live slots into the holes."""
        if not done:
            return []
        reasons = [reasons] * len(done) if isinstance(reasons, str) else reasons
        out = [self._completion(self.running[i], r) for i, r in zip(done, reasons)]
        for i, r in zip(done, reasons):
            if r != "abort":
                self._keep(self.running[i], i)
        gone = set(done)
        alive = len(self.running) - len(gone)
        holes = [i for i in range(alive) if i in gone]
        movers = [i for i in range(alive, len(self.running)) if i not in gone]
        if movers:
            self.cache.move(movers, holes, int(self.slots.position[movers].max()))
            self.slots.move(movers, holes)
            for hole, mover in zip(holes, movers):
                self.running[hole] = self.running[mover]
        self.slots.free(alive, len(self.running))
        del self.running[alive:]
        self._decode_rows = None
        return out

    def _completion(self, seq: _Sequence, reason: FinishReason) -> Completion:
        text_ids = seq.tokens[:-1] if reason == "stop" else seq.tokens
        text = self._decode_text(text_ids) if self._decode_text else ""
        return Completion(
            list(seq.prompt),
            list(seq.tokens),
            list(seq.logprobs),
            list(seq.versions),
            reason,
            text,
            seq.request_id,
            seq.index,
            seq.seed,
        )


def decode_rows(batch: int, max_batch: int) -> int:
    """Rows the decode forward runs for a batch of `batch`: rounded up to a multiple of 8, or of an
    eighth of the next power of two when that is larger (at most 12.5% extra rows), capped at
    `max_batch` -- about 8 distinct sizes per power of two instead of every size."""
    step = max(8, (1 << (batch - 1).bit_length()) // 8)
    return min(max_batch, -(-batch // step) * step)
