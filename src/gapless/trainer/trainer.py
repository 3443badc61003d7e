"""The GRPO trainer: one optimizer step per batch, algorithm-blind beyond a loss chosen by name.

A step makes `epochs` updates on its batch (stats are those of the last update). Each update
splits the batch into micro-batches and accumulates gradients with normalisers counted once over
the whole step (normalisers.StepNorm), so the result equals one big batch for every loss; then
it clips the global gradient norm and takes one AdamW step. Micro-batches are cut by rows
(padded) or, with `trainer.max_tokens_per_micro_batch`, by tokens and packed (packing.py): the
same gradient within float rounding. At cluster.trainer_world_size > 1
every rank runs this same `update` on its rows of the step, with the whole step's normalisers
and a `ShardPlan` (trainer/distributed.py). `version` counts published steps;
`state_for_push` hands the weights to the generator. The reference model for the KL term is a
frozen copy taken at creation.

With `lora` (a LoRA run, `[lora]`) the trainer adapts the model with peft adapters on the same
(frozen, shared) base tensors (lora.attach_lora with share_weights): the optimizer holds only
the adapter parameters, `state_for_push` is the adapter tensors alone, and the KL reference is
the same model with its adapters disabled (peft's `disable_adapter`), no second copy.

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

import contextlib
import copy
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, runtime_checkable

import torch

from gapless.config import TrainerConfig
from gapless.lora import LoraSpec, adapter_state, attach_lora
from gapless.trainer.batch import Batch, first_trained_position, token_logprobs, token_logprobs_and_entropy
from gapless.trainer.corrections import importance_weights, summarise
from gapless.trainer.losses import LOSSES
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.packing import packed_logprobs_and_entropy
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
    offpolicy_parts: list[dict[str, float]] = field(default_factory=list)  # per micro-batch, for merging ranks


@dataclass(frozen=True)
class ShardPlan:
    """How one data-parallel rank runs its rows of a step (trainer/distributed.py): every rank
    makes `num_micro_batches` forward/backward passes, hence the same collectives, padding with
    `padding` (one row, loss mask 0: zero loss, zero gradient); `no_sync` holds the gradient
    reduction back on all passes but the last; `loss_scale` (the world size) undoes the mean the
    reduction takes over ranks, so the reduced gradient is the whole step's."""

    num_micro_batches: int
    padding: Batch
    loss_scale: float
    no_sync: Callable[[], contextlib.AbstractContextManager]


class OptimizerState(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """Everything the run loop touches of a trainer. GRPOTrainer runs in one process;
    DataParallelTrainer (trainer/distributed.py) over W ranks; one contract test covers both
    (tests/unit/test_distributed.py)."""

    model: torch.nn.Module  # plain and full, holding the current weights (a LoRA run: the peft model over the base)
    version: int  # published steps; the loop sets it on --resume
    optimizer: OptimizerState  # what checkpoints save and load (world 1's format)

    def step(self, batch: Batch) -> StepStats: ...
    def state_for_push(self) -> dict[str, torch.Tensor]: ...
    def reference_kl(self, batch: Batch) -> list[float]: ...


class GRPOTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        temperature: float = 1.0,
        max_new_tokens: int | None = None,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        lora: LoraSpec | None = None,
    ):
        """`wrap`: data-parallel wrapping (DDP, fully_shard; trainer/distributed.py), applied after
        the reference copy is taken and before the optimizer sees the parameters. `lora`: train
        that adapter on `model`'s frozen weights instead of the weights themselves."""
        if cfg.loss == "drgrpo" and max_new_tokens is None:
            raise ValueError("trainer.loss = 'drgrpo' divides by generator.max_new_tokens; pass max_new_tokens")
        self.cfg = cfg
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens or 0  # only Dr. GRPO's constant normaliser uses it
        self.loss_fn = LOSSES[cfg.loss]
        if cfg.gradient_checkpointing:  # active in train mode only, i.e. inside `step`
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora
        if lora is not None:
            model = attach_lora(model, lora, share_weights=True)
        self.reference = None
        if cfg.kl_coef > 0 and lora is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.model = wrap(model) if wrap is not None else model
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0

    def step(self, batch: Batch) -> StepStats:
        """`cfg.epochs` optimizer updates on `batch`, published as one new policy version.

        A batch without a loss token (every group dropped or masked) publishes the same weights:
        no optimizer step, so AdamW's momentum does not move them on zero gradients.
        """
        norm = StepNorm.of(batch.loss_mask, batch.group_ids, self.max_new_tokens)
        stats = StepStats(0.0, 0.0, 0.0, 0.0, 0.0, 0)
        if norm.num_tokens > 0:
            stats = self.update(batch, norm)
        self.version += 1
        return stats

    def update(self, batch: Batch, norm: StepNorm, shard: ShardPlan | None = None) -> StepStats:
        """The step's `epochs` optimizer updates on `batch`: the whole step, or with `shard` one
        data-parallel rank's rows of it (`norm` is always counted over the whole step)."""
        self.model.train()
        start_logprobs = torch.zeros_like(batch.behaviour_logprobs)  # (B, T) filled by update 1
        for epoch in range(self.cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            stats = self.accumulate_gradients(batch, norm, start_logprobs, epoch == 0, shard)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor
                grad_norm = grad_norm.full_tensor()
            stats.grad_norm = float(grad_norm)
            self.optimizer.step()
        self.model.eval()
        return stats

    def accumulate_gradients(
        self,
        batch: Batch,
        norm: StepNorm,
        start_logprobs: torch.Tensor,
        is_first: bool = True,
        shard: ShardPlan | None = None,
    ) -> StepStats:
        """Forward/backward every micro-batch, adding into `.grad`; the optimizer is not touched.
        With `shard` (data parallel) the stats count this rank's rows only."""
        cfg = self.cfg
        totals = {"loss": 0.0, "clip": 0.0, "ratio": 0.0, "kl": 0.0, "entropy": 0.0}
        offpolicy: list[dict[str, float]] = []
        parts: list[tuple[torch.Tensor | None, Batch]] = list(
            batch.cut(cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
        )
        scale, no_sync = 1.0, contextlib.nullcontext
        if shard is not None:
            parts += [(None, shard.padding)] * (shard.num_micro_batches - len(parts))
            scale, no_sync = shard.loss_scale, shard.no_sync
        for count, (index, mb) in enumerate(parts):
            with no_sync() if count < len(parts) - 1 else contextlib.nullcontext():
                self._micro_batch(mb, index, norm, start_logprobs, is_first, scale, totals, offpolicy)
        denom = max(norm.num_tokens, 1)
        return StepStats(
            loss=totals["loss"],
            grad_norm=0.0,
            clip_frac=totals["clip"] / denom,
            ratio_mean=totals["ratio"] / denom,
            kl_mean=totals["kl"] / denom,
            num_tokens=norm.num_tokens,
            entropy_mean=totals["entropy"] / denom,
            offpolicy=summarise(offpolicy, cfg.correction),
            offpolicy_parts=offpolicy,
        )

    def _micro_batch(
        self,
        mb: Batch,
        index: torch.Tensor | None,
        norm: StepNorm,
        start_logprobs: torch.Tensor,
        is_first: bool,
        loss_scale: float,
        totals: dict[str, float],
        offpolicy: list[dict[str, float]],
    ) -> None:
        """One forward/backward; `index` None marks a loss-free padding pass (data parallel)."""
        cfg = self.cfg
        width, first = mb.loss_mask.shape[1], first_trained_position(mb.loss_mask)  # no LM head over the prompts
        logprobs, entropy = self._logprobs_and_entropy(self.model, mb, first)
        if index is None:
            trainer_start, mb_norm = logprobs.detach(), replace(norm, group_sizes=torch.zeros(len(mb)))
        else:
            if is_first:
                start_logprobs[index, :width] = logprobs.detach()
            trainer_start, mb_norm = start_logprobs[index, :width], norm.select(index)
        old = trainer_start if cfg.old_logprobs == "trainer" else mb.behaviour_logprobs
        policy = self.loss_fn(
            logprobs,
            old,
            mb.advantages,
            mb.loss_mask,
            mb_norm,
            cfg.clip_eps,
            cfg.clip_high,
            **({"dual_clip_c": cfg.dual_clip_c} if cfg.dual_clip_c is not None else {}),
        )
        rho, diagnostics = importance_weights(
            trainer_start,
            mb.behaviour_logprobs,
            mb.loss_mask,
            cfg.correction,
            cfg.correction_level,
            cfg.tis_cap,
            cfg.mis_low,
            cfg.mis_high,
        )
        if index is not None:
            offpolicy.append(diagnostics)
        per_token = policy.per_token
        if cfg.correction != "none":
            per_token = per_token * rho
        if self.has_reference and cfg.kl_placement == "loss":
            kl = token_kl(logprobs, self._reference_logprobs(mb, first), mb.loss_mask, cfg.kl_estimator)
            per_token = per_token + cfg.kl_coef * kl
            totals["kl"] += float((kl.detach() * mb.loss_mask).sum())
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy
        loss = (per_token * policy.weights).sum()
        (loss * loss_scale).backward()
        totals["loss"] += loss.item()
        totals["clip"] += float((policy.is_clipped * mb.loss_mask).sum())
        totals["ratio"] += float((policy.ratio * mb.loss_mask).sum())
        totals["entropy"] += float((entropy.detach() * mb.loss_mask).sum())

    @property
    def has_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    @torch.no_grad()
    def _reference_logprobs(self, mb: Batch, first: int = 0) -> torch.Tensor:
        if self.lora is not None:  # the base model is the reference: the adapters switched off
            with self.model.disable_adapter():
                return self._logprobs(self.model, mb, first)
        return self._logprobs(self.reference, mb, first)

    def _logprobs(self, model: torch.nn.Module, mb: Batch, first: int) -> torch.Tensor:
        if self.cfg.max_tokens_per_micro_batch > 0:
            return packed_logprobs_and_entropy(
                model, mb.input_ids, mb.attention_mask, mb.loss_mask != 0, self.temperature
            )[0]
        return token_logprobs(model, mb.input_ids, mb.attention_mask, self.temperature, first)

    def _logprobs_and_entropy(self, model: torch.nn.Module, mb: Batch, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs and entropies of `mb`'s rows: packed and chunked at the loss tokens
        (packing.py) under a token budget, else padded from position `first` on."""
        if self.cfg.max_tokens_per_micro_batch > 0:
            return packed_logprobs_and_entropy(
                model, mb.input_ids, mb.attention_mask, mb.loss_mask != 0, self.temperature
            )
        return token_logprobs_and_entropy(
            model,
            mb.input_ids,
            mb.attention_mask,
            self.temperature,
            entropy_grad=self.cfg.entropy_coef > 0,
            first=first,
        )

    @torch.no_grad()
    def reference_kl(self, batch: Batch) -> list[float]:
        """KL to the reference of each completion under its behaviour log-probs (for kl_placement =
        'reward'): the sum over its loss tokens of the per-token estimate."""
        assert self.has_reference, "reference_kl needs trainer.kl_coef > 0"
        out = [0.0] * len(batch)
        for index, mb in batch.cut(self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch):
            ref = self._reference_logprobs(mb)
            for row, kl in zip(
                index.tolist(), sequence_kl(mb.behaviour_logprobs, ref, mb.loss_mask, self.cfg.kl_estimator).tolist()
            ):
                out[row] = kl
        return out

    def state_for_push(self) -> dict[str, torch.Tensor]:
        """The full HF state dict, or in a LoRA run the adapter tensors alone (peft's names)."""
        if self.lora is not None:
            return adapter_state(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}
