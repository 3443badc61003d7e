"""The GRPO trainer: one optimizer step per batch, algorithm-blind beyond a loss chosen by name.

A step makes `epochs` updates on its batch (stats are those of the last update). Each update
splits the batch into micro-batches and accumulates gradients with normalisers counted once over
the whole step (normalisers.StepNorm), so the result equals one big batch for every loss; then
it clips the global gradient norm and takes one AdamW step. `version` counts published steps;
`state_for_push` hands the weights to the generator. The reference model for the KL term is a
frozen copy taken at creation.

Three log-probs per token, and which ratio uses which:
    behaviour   generator's sampling log-probs, recorded with the completion (Batch)
    start       the trainer's own log-probs at the start of the step -- the first update's
                forward pass, before any optimizer step, kept (no gradient) for later updates
    current     this update's forward pass, with gradient
    PPO ratio r = current / old,  old = behaviour (trainer.old_logprobs = 'behaviour', default)
                                  or start     (trainer.old_logprobs = 'trainer'; r = 1 in update 1)
    correction rho = start / behaviour  (corrections.py; weights the policy term; metrics always)
With epochs = 1 and zero staleness, behaviour = start up to float tolerance, so both choices train
the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from gapless.config import TrainerConfig
from gapless.trainer.batch import Batch, token_logprobs, token_logprobs_and_entropy
from gapless.trainer.corrections import importance_weights, summarise
from gapless.trainer.losses import LOSSES
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.regularizers import sequence_kl, token_kl


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    clip_frac: float
    ratio_mean: float
    kl_mean: float
    num_tokens: int
    entropy_mean: float = 0.0
    offpolicy: dict[str, float] = field(default_factory=dict)


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, temperature: float = 1.0, max_new_tokens: int | None = None):
        if cfg.loss == "drgrpo" and max_new_tokens is None:
            raise ValueError("trainer.loss = 'drgrpo' divides by generator.max_new_tokens; pass max_new_tokens")
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens or 0  # only Dr. GRPO's constant normaliser uses it
        self.loss_fn = LOSSES[cfg.loss]
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.version = 0

    def step(self, batch: Batch) -> StepStats:
        """`cfg.epochs` optimizer updates on `batch`, published as one new policy version.

        A batch without a loss token (every group dropped or masked) publishes the same weights:
        no optimizer step, so AdamW's momentum does not move them on zero gradients.
        """
        norm = StepNorm.of(batch.loss_mask, batch.group_ids, self.max_new_tokens)
        stats = StepStats(0.0, 0.0, 0.0, 0.0, 0.0, 0)
        if norm.num_tokens > 0:
            self.model.train()
            start_logprobs = torch.zeros_like(batch.behaviour_logprobs)  # (B, T) filled by update 1
            for epoch in range(self.cfg.epochs):
                self.optimizer.zero_grad(set_to_none=True)
                stats = self.accumulate_gradients(batch, norm, start_logprobs, is_first=epoch == 0)
                stats.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
                self.optimizer.step()
            self.model.eval()
        self.version += 1
        return stats

    def accumulate_gradients(self, batch: Batch, norm: StepNorm, start_logprobs: torch.Tensor, is_first: bool = True) -> StepStats:
        """Forward/backward every micro-batch, adding into `.grad`; the optimizer is not touched."""
        cfg = self.cfg
        totals = {"loss": 0.0, "clip": 0.0, "ratio": 0.0, "kl": 0.0, "entropy": 0.0}
        offpolicy = []
        for index, mb in batch.micro_batches(cfg.micro_batch_size):
            width = mb.loss_mask.shape[1]
            logprobs, entropy = token_logprobs_and_entropy(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                                                           entropy_grad=cfg.entropy_coef > 0)
            if is_first:
                start_logprobs[index, :width] = logprobs.detach()
            trainer_start = start_logprobs[index, :width]
            old = trainer_start if cfg.old_logprobs == "trainer" else mb.behaviour_logprobs
            policy = self.loss_fn(logprobs, old, mb.advantages, mb.loss_mask, norm.select(index), cfg.clip_eps, cfg.clip_high,
                                  **({"dual_clip_c": cfg.dual_clip_c} if cfg.dual_clip_c is not None else {}))
            rho, diagnostics = importance_weights(trainer_start, mb.behaviour_logprobs, mb.loss_mask, cfg.correction,
                                                  cfg.correction_level, cfg.tis_cap, cfg.mis_low, cfg.mis_high)
            offpolicy.append(diagnostics)
            per_token = policy.per_token
            if cfg.correction != "none":
                per_token = per_token * rho
            if self.reference is not None and cfg.kl_placement == "loss":
                kl = token_kl(logprobs, self._reference_logprobs(mb), mb.loss_mask, cfg.kl_estimator)
                per_token = per_token + cfg.kl_coef * kl
                totals["kl"] += float((kl.detach() * mb.loss_mask).sum())
            if cfg.entropy_coef > 0:
                per_token = per_token - cfg.entropy_coef * entropy
            loss = (per_token * policy.weights).sum()
            loss.backward()
            totals["loss"] += loss.item()
            totals["clip"] += float((policy.is_clipped * mb.loss_mask).sum())
            totals["ratio"] += float((policy.ratio * mb.loss_mask).sum())
            totals["entropy"] += float((entropy.detach() * mb.loss_mask).sum())
        denom = max(norm.num_tokens, 1)
        return StepStats(
            loss=totals["loss"], grad_norm=0.0, clip_frac=totals["clip"] / denom, ratio_mean=totals["ratio"] / denom,
            kl_mean=totals["kl"] / denom, num_tokens=norm.num_tokens, entropy_mean=totals["entropy"] / denom,
            offpolicy=summarise(offpolicy, cfg.correction),
        )

    @torch.no_grad()
    def _reference_logprobs(self, mb: Batch) -> torch.Tensor:
        return token_logprobs(self.reference, mb.input_ids, mb.attention_mask, self.temperature)

    @torch.no_grad()
    def reference_kl(self, batch: Batch) -> list[float]:
        """KL to the reference of each completion under its behaviour log-probs (for kl_placement =
        'reward'): the sum over its loss tokens of the per-token estimate."""
        assert self.reference is not None, "reference_kl needs trainer.kl_coef > 0"
        out = [0.0] * len(batch)
        for index, mb in batch.micro_batches(self.cfg.micro_batch_size):
            ref = self._reference_logprobs(mb)
            for row, kl in zip(index.tolist(), sequence_kl(mb.behaviour_logprobs, ref, mb.loss_mask, self.cfg.kl_estimator).tolist()):
                out[row] = kl
        return out

    def state_for_push(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}
