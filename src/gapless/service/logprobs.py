"""The log-prob options of an SDK `SampleRequest` (tinker 0.38), computed by full forward passes.

    requested(body, prompt, vocab_size) -> LogprobOptions      validate; UserError names the option
    compute(model, prompt, samples, options) -> SampleExtras   one forward over the prompt, one per
                                                               sample when top-k sample log-probs
    SampleExtras.write(pb.SampleResponse)                      the SDK's response fields

What each option returns (position t of the prompt is scored from prompt[:t]; t = 0 has no context):
- `prompt_logprobs`: log p(prompt[t]) at every t, NaN at t = 0 and, with `prompt_logprobs_last_n`
  = N, at every t < len(prompt) - N (N from 1 to len(prompt) - 1; needs `prompt_logprobs`);
- `topk_prompt_logprobs` = k: the k most likely tokens at each t, sorted, the same rows empty;
- `target_prompt_logprobs`: an int64 [len(prompt) - 1, K] tensor, dense or sparse CSR; cell
  [i, j] gets log p(id) at t = i + 1, 0.0 where the id is -1; same shape and layout back;
- `prompt_alt_tokens_k` = k: k draws with replacement from the next-token distribution at every
  t >= 1, at the request's temperature (greedy: the argmax), and their log-probs under that
  distribution (a greedy request's at temperature 1, as the engine records its own);
- `topk_sample_logprobs` = k: the k most likely tokens at each sampled position, at the sampling
  temperature, the convention of the sampled tokens' own log-probs.
The prompt options are at temperature 1: the model's own distribution, as `forward` gives it.
Guaranteed: each value is that of one fp32 forward pass of the weights that sampled (tested against
the trainer's `forward`); `record_stability_info` is refused by name (it serves `stable_reinforce`,
which is not served). Not guaranteed: the effect of top-p / top-k truncation on any of these (the
engine's own sampled-token log-probs include it), nor the engine's numbers to the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from gapless.service.models import UserError

MASK_LOGPROB = -99999.0  # the SDK's empty top-k cell (token id 0, this log-prob)


@dataclass(frozen=True)
class TargetCells:
    """`target_prompt_logprobs` as cells: (row, col, id) per listed cell, and the layout to send back."""

    rows: np.ndarray  # (C,) int64
    ids: np.ndarray  # (C,) int64, -1 = nothing requested
    shape: tuple[int, int]
    crow: list[int] | None = None  # CSR row pointers and column indices, kept as the request sent them
    col: list[int] | None = None


@dataclass(frozen=True)
class LogprobOptions:
    prompt_logprobs: bool = False
    last_n: int | None = None
    topk_prompt: int = 0
    targets: TargetCells | None = None
    alt_k: int = 0
    topk_sample: int = 0
    temperature: float = 1.0  # the sampling temperature (1 for greedy, as the engine records it)
    greedy: bool = False
    seed: int = 0

    @property
    def needs_prompt_pass(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt > 0 or self.targets is not None or self.alt_k > 0


def requested(body: tt.SampleRequest, prompt: list[int], vocab_size: int, seed: int) -> LogprobOptions:
    """The options `body` asks for, checked against the prompt; UserError names the option at fault."""
    if body.record_stability_info:
        raise UserError(
            "record_stability_info is not served: stability information only serves the stable_reinforce "
            "loss, which this service does not serve (its objective is unpublished); sample without it. "
            "tinker-cookbook's RL recipes ask for it when loss_fn is stable_reinforce (their default): "
            "pass loss_fn=importance_sampling (or ppo, cispo, dro, gspo) on the command line"
        )
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name) < 0:
            raise UserError(f"{name} must be 0 or more (got {getattr(body, name)})")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not body.prompt_logprobs:
            raise UserError("prompt_logprobs_last_n applies to prompt log-probs: set prompt_logprobs too")
        if not 1 <= last_n <= len(prompt) - 1:
            raise UserError(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1} (got {last_n})"
            )
    scored = ("topk_prompt_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k")
    if len(prompt) < 2 and any(getattr(body, n) for n in scored):
        raise UserError(f"{', '.join(scored)} need a prompt of at least 2 tokens (position 0 has no context)")
    sp = body.sampling_params
    greedy = sp.temperature <= 0
    return LogprobOptions(
        prompt_logprobs=bool(body.prompt_logprobs),
        last_n=last_n,
        topk_prompt=body.topk_prompt_logprobs,
        targets=_targets(body.target_prompt_logprobs, len(prompt), vocab_size),
        alt_k=body.prompt_alt_tokens_k,
        topk_sample=body.topk_sample_logprobs,
        temperature=1.0 if greedy else sp.temperature,
        greedy=greedy,
        seed=seed,
    )


def _targets(td, prompt_len: int, vocab_size: int) -> TargetCells | None:
    if td is None:
        return None
    where = "target_prompt_logprobs"
    shape = td.shape or []
    if td.dtype != "int64" or len(shape) != 2:
        raise UserError(f"{where} must be an int64 tensor of shape [len(prompt) - 1, K] (got {td.dtype} {shape})")
    if shape[0] != prompt_len - 1:
        raise UserError(f"{where} has {shape[0]} rows; it needs len(prompt) - 1 = {prompt_len - 1}")
    ids = np.asarray(td.data, dtype=np.int64)
    if td.sparse_crow_indices is not None:
        crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(td.sparse_col_indices or [], dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(ids) or crow[-1] != len(ids) or np.any(np.diff(crow) < 0):
            raise UserError(f"{where}: sparse CSR indices inconsistent with shape {shape} and {len(ids)} values")
        if len(col) and (col.min() < 0 or col.max() >= shape[1]):
            raise UserError(f"{where}: a CSR column index is outside 0..{shape[1] - 1}")
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        cells = TargetCells(rows, ids, (shape[0], shape[1]), crow.tolist(), col.tolist())
    else:
        if ids.size != shape[0] * shape[1]:
            raise UserError(f"{where}: {ids.size} values do not fill shape {shape}")
        cells = TargetCells(np.repeat(np.arange(shape[0]), shape[1]), ids, (shape[0], shape[1]))
    if not np.any(ids >= 0):
        raise UserError(f"{where} names no token id (every cell is -1)")
    if np.any((ids < -1) | (ids >= vocab_size)):
        bad = int(ids[(ids < -1) | (ids >= vocab_size)][0])
        raise UserError(f"{where} holds token id {bad}, outside the vocabulary (0..{vocab_size - 1}, or -1 for none)")
    return cells


@dataclass
class SampleExtras:
    """What `compute` found, in the SDK's layouts (numpy), ready for `write`."""

    prompt_logprobs: np.ndarray | None = None  # (P,) float32, NaN where not scored
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None  # (P, k) int32 ids, (P, k) float32
    target_values: np.ndarray | None = None  # (C,) float32, one per listed cell
    targets: TargetCells | None = None
    alt: tuple[np.ndarray, np.ndarray] | None = None  # (P - 1, k) int64 ids, (P - 1, k) float32
    topk_samples: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per sequence

    def write(self, out: pb.SampleResponse) -> None:
        if self.prompt_logprobs is not None:
            out.prompt_logprobs = self.prompt_logprobs.astype(np.float32).tobytes()
        if self.topk_prompt is not None:
            _write_topk(out.topk_prompt_logprobs, *self.topk_prompt)
        if self.targets is not None and self.target_values is not None:
            t = self.targets
            if t.crow is not None:  # sparse in, sparse out: the same indices
                msg = out.target_prompt_logprobs
                msg.dtype = pb.DTYPE_FLOAT32
                msg.shape[:] = list(t.shape)
                csr = msg.sparse_csr
                csr.values = self.target_values.astype(np.float32).tobytes()
                csr.crow_indices = np.asarray(t.crow, dtype=np.int64).tobytes()
                csr.col_indices = np.asarray(t.col, dtype=np.int64).tobytes()
            else:
                _dense(out.target_prompt_logprobs, self.target_values, list(t.shape), pb.DTYPE_FLOAT32)
        if self.alt is not None:
            ids, lps = self.alt
            _dense(out.prompt_alt_tokens.tokens, ids.astype(np.int64), list(ids.shape), pb.DTYPE_INT64)
            _dense(out.prompt_alt_tokens.logprobs, lps, list(lps.shape), pb.DTYPE_FLOAT32)
        for seq, (ids, lps) in zip(out.sequences, self.topk_samples):
            _write_topk(seq.topk_sampled_logprobs, ids, lps)


def _dense(msg: pb.Tensor, values: np.ndarray, shape: list[int], dtype) -> None:
    msg.dtype = dtype
    msg.shape[:] = shape
    msg.dense = np.ascontiguousarray(values).tobytes()


def _write_topk(msg: pb.TopkLogprobs, ids: np.ndarray, lps: np.ndarray) -> None:
    msg.length, msg.k = ids.shape
    msg.token_ids = ids.astype(np.int32).tobytes()
    msg.logprobs = lps.astype(np.float32).tobytes()


@torch.no_grad()
def compute(model: torch.nn.Module, prompt: list[int], samples: list[list[int]], o: LogprobOptions) -> SampleExtras:
    """Every option `o` asks for, on `model` (the weights that sampled), in fp32."""
    extras = SampleExtras(targets=o.targets)
    n = len(prompt)
    if o.prompt_logprobs and n < 2:  # nothing to score: position 0 has no context
        extras.prompt_logprobs = np.full(n, np.nan, dtype=np.float32)
    if o.needs_prompt_pass and n >= 2:
        logits = model(input_ids=torch.tensor([prompt])).logits[0, : n - 1].float()  # (P-1, V): row i scores t = i+1
        logp = torch.log_softmax(logits, dim=-1)
        first = 1 if o.last_n is None else n - o.last_n  # the first position scored
        if o.prompt_logprobs:
            values = np.full(n, np.nan, dtype=np.float32)
            values[1:] = logp.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1).numpy()
            values[:first] = np.nan
            extras.prompt_logprobs = values
        if o.topk_prompt:
            ids, lps = _topk(logp, o.topk_prompt)  # (P-1, k)
            full_ids = np.zeros((n, o.topk_prompt), np.int32)
            full_lps = np.full((n, o.topk_prompt), MASK_LOGPROB, np.float32)
            full_ids[first:], full_lps[first:] = ids[first - 1 :], lps[first - 1 :]
            extras.topk_prompt = (full_ids, full_lps)
        if o.targets is not None:
            rows, ids = torch.from_numpy(o.targets.rows), torch.from_numpy(o.targets.ids)
            values = logp[rows, ids.clamp(min=0)]
            extras.target_values = torch.where(ids >= 0, values, torch.zeros_like(values)).numpy()
        if o.alt_k:
            extras.alt = _draws(logits, o)
    if o.topk_sample:
        for sample in samples:
            extras.topk_samples.append(_topk_of_sample(model, prompt, sample, o))
    return extras


def _topk(logp: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of each row, sorted; a k past the vocabulary is padded with empty cells."""
    values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
    ids = np.zeros((logp.shape[0], k), np.int32)
    lps = np.full((logp.shape[0], k), MASK_LOGPROB, np.float32)
    ids[:, : indices.shape[1]], lps[:, : values.shape[1]] = indices.numpy(), values.numpy()
    return ids, lps


def _draws(logits: torch.Tensor, o: LogprobOptions) -> tuple[np.ndarray, np.ndarray]:
    """`alt_k` draws per row at the request's temperature (the argmax, for greedy) and their log-probs."""
    logp = torch.log_softmax(logits / o.temperature, dim=-1)  # (P-1, V)
    if o.greedy:
        ids = logp.argmax(-1, keepdim=True).expand(-1, o.alt_k)
    else:
        generator = torch.Generator().manual_seed(o.seed)
        ids = torch.multinomial(logp.exp(), o.alt_k, replacement=True, generator=generator)
    return ids.numpy().astype(np.int64), logp.gather(-1, ids).numpy()


def _topk_of_sample(model, prompt: list[int], sample: list[int], o: LogprobOptions) -> tuple[np.ndarray, np.ndarray]:
    if not sample:
        return np.zeros((0, o.topk_sample), np.int32), np.zeros((0, o.topk_sample), np.float32)
    ids = prompt + sample
    logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : len(ids) - 1].float()  # (S, V)
    return _topk(torch.log_softmax(logits / o.temperature, dim=-1), o.topk_sample)
