"""Log-probs the engine does not record: the prompt's own (echo) and the top alternatives of each token.

One full forward pass of the served checkpoint over prompt + completion gives, at every position
t >= start, log p(ids[t] | ids[:t]) and the k most likely tokens, at the sampling temperature
(1 for greedy requests, as the engine records them). It runs beside the engine (the route calls
it from a worker thread), on the HF module the engine was built from.
Guaranteed: the top alternatives sum no more than 1 in probability, and are sorted. Not
guaranteed: that they equal the engine's numbers to the last bit (cached decoding and a full
forward differ by fp32 rounding), nor any effect of top-p/top-k truncation (the engine's own
sampling log-probs, in `token_logprobs`, include it; these alternatives do not).
"""

from __future__ import annotations

import torch


class Scorer:
    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def score(
        self, ids: list[int], start: int, temperature: float = 1.0, top: int = 0
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """For t in start..len(ids)-1: the log-prob of ids[t], and its `top` alternatives (id, log-prob)."""
        start = max(start, 1)
        if start >= len(ids):
            return [], []
        logits = self.model(input_ids=torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].float()  # (T, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        chosen = logp.gather(-1, torch.tensor(ids[start:])[:, None]).squeeze(-1).tolist()
        if top == 0:
            return chosen, [[] for _ in chosen]
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
        return chosen, [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
