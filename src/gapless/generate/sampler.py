"""Batched sampling with a KV cache over any Hugging Face causal LM: the reference generator.

Prompts are left-padded into one batch, prefilled once, then decoded one token per step reusing
the cache; positions are derived from the attention mask so padding never shifts them. Each
token's log-prob is taken under the distribution actually sampled from (temperature applied;
with top-p < 1 the trainer, which does not truncate, sees a slightly different distribution).
Guarantees: greedy decoding equals argmax of a full recomputation (tested); sequences stop at
EOS or `max_new_tokens`; sampling is reproducible for a given `SamplingParams.seed`.
It is the simple implementation the torch engine (`engine.py`: continuous batching, shared
prefill, in-flight weight swaps) is tested against, and the fallback for architectures the engine
does not implement (`generator.engine = "reference"`).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from gapless.types import Completion, SamplingParams


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, P)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def sample_next(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it and its log-prob under the sampling distribution."""
    if params.greedy:
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
        token = logprobs.argmax(dim=-1)
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits.float() / params.temperature, dim=-1)  # (B, V)
    probs = logprobs.exp()
    if params.top_k > 0:
        kth = probs.topk(min(params.top_k, probs.shape[-1]), dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # (B,)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


class TorchSampler:
    """Holds its own copy of the policy; the trainer pushes weights with `update_weights`."""

    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, decode=None, stop_ids=()):
        self.model = model
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids)  # besides eos: e.g. a chat template's end-of-turn token
        self.pad_id = pad_id
        self.version = 0
        self.adapters = None  # an AdapterMerge in a LoRA run (make_generator)
        self._decode = decode
        # transformers >= 5.x names the cache argument `cache`; 4.x calls it `past_key_values`
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        return out.logits[:, -1]  # (B, V)

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            if self.adapters is not None:  # a LoRA push (generate/adapters.py): merge layer by layer
                own = self.model.state_dict()
                self.adapters.load(state, lambda merged: [own[k].copy_(v) for k, v in merged.items()])
            else:
                self.model.load_state_dict(state, strict=True)
        self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        gen = torch.Generator().manual_seed(params.seed)
        ids, mask = left_pad(prompts, self.pad_id)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        cache = DynamicCache()
        logits = self._forward(ids, mask, positions, cache)  # (B, V)
        batch = len(prompts)
        stops = torch.tensor(
            sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_id} | self.stop_ids)),
            dtype=torch.long,
        )
        tokens, logps = [], []
        done = torch.zeros(batch, dtype=torch.bool)
        for _ in range(params.max_new_tokens):
            token, logp = sample_next(logits, params, gen)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logps.append(logp)
            done |= torch.isin(token, stops)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(token[:, None], mask, positions, cache)
        stop_set = set(stops.tolist())
        return [self._completion(prompts[i], tokens, logps, i, stop_set) for i in range(batch)]

    def _completion(
        self, prompt: list[int], tokens: list[torch.Tensor], logps: list[torch.Tensor], row: int, stops: set[int]
    ) -> Completion:
        ids, lps, reason = [], [], "length"
        for tok, lp in zip(tokens, logps):
            t = int(tok[row])
            ids.append(t)
            lps.append(float(lp[row]))
            if t in stops:
                reason = "stop"
                break
        text_ids = ids[:-1] if reason == "stop" else ids
        text = self._decode(text_ids) if self._decode else ""
        return Completion(list(prompt), ids, lps, [self.version] * len(ids), reason, text)
