"""The GRPO trainer: one optimizer step per batch, algorithm-blind beyond the loss function.

A step makes `epochs` updates on its batch (stats are those of the last update); each update splits the batch into micro-batches, accumulates gradients with the step-wide token
count as normaliser (so the result equals one big batch), clips the global gradient norm and
takes one AdamW step. `version` counts published steps; `state_for_push` hands the weights to
the generator. The reference model for the optional KL term is a frozen copy taken at creation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from gapless.config import TrainerConfig
from gapless.trainer.batch import Batch, token_logprobs
from gapless.trainer.losses import grpo_token_loss


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    clip_frac: float
    ratio_mean: float
    kl_mean: float
    num_tokens: int


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, temperature: float = 1.0):
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.version = 0

    def step(self, batch: Batch) -> StepStats:
        """`cfg.epochs` optimizer updates on `batch`, published as one new policy version."""
        self.model.train()
        for _ in range(self.cfg.epochs):
            stats = self._update(batch)
        self.model.eval()
        self.version += 1
        return stats

    def _update(self, batch: Batch) -> StepStats:
        num_tokens = batch.num_tokens
        totals = {"loss": 0.0, "clip_count": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batch), self.cfg.micro_batch_size):
            mb = batch.rows(start, start + self.cfg.micro_batch_size)
            logprobs = token_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, mb.input_ids, mb.attention_mask, self.temperature)
            loss, stats = grpo_token_loss(
                logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, num_tokens,
                clip_eps=self.cfg.clip_eps, kl_coef=self.cfg.kl_coef, ref_logprobs=ref,
            )
            loss.backward()
            totals["loss"] += loss.item()
            for key, value in stats.items():
                totals[key] += value
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        denom = max(num_tokens, 1)
        return StepStats(
            loss=totals["loss"],
            grad_norm=float(grad_norm),
            clip_frac=totals["clip_count"] / denom,
            ratio_mean=totals["ratio_sum"] / denom,
            kl_mean=totals["kl_sum"] / denom,
            num_tokens=num_tokens,
        )

    def state_for_push(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}
