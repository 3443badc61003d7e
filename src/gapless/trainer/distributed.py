"""Trainer data parallel over torch.distributed: DDP or FSDP2, gloo on CPU.

Rank 0 is the run's trainer process; ranks 1..W-1 run where its `RankHosts` puts them
(cluster/ranks.py: processes on this machine by default, Ray actors in the run's placement group
with cluster.placement = 'ray') and die with it (trainer/dp_rank.py: the records the ranks
exchange and what each rank runs). Each
step rank 0 deals the batch's rows to the ranks (sorted by length, round-robin, so each gets a
similar token count), counts the normalisers once over the whole step (normalisers.StepNorm),
and sends every other rank its share as a typed record. Every rank then runs the same GRPO code
as world 1 (GRPOTrainer.update) on its rows:

    rank 0 (trainer process)                       rank r (spawned, one per r)
    StepNorm over the whole batch, deal rows ─StepShare──> inbox
    update(own rows)  ══ gloo collectives (gradients; FSDP2 also weights) ══  update(its rows)
    poll ranks every 0.1 s while waiting <────ShareDone── outbox (its stats; its error if any)
    merge stats; FSDP2: full weights gathered into `model` (a collective of all ranks)

Guaranteed:
- the reduced gradient is world 1's: every rank divides by the whole step's counts and scales
  its loss by W to undo the reduction's mean, so after a step the weights, the loss and the
  gradient norm equal world 1's up to float rounding (tested at 1e-6 for both wrappings);
- every rank makes the same number of forward/backward passes (padding with a loss-free row),
  so the collectives match; the gradient is reduced once, on the last pass (no_sync before);
- clipping uses the global gradient norm (DDP: every rank holds the full reduced gradient;
  FSDP2: clip_grad_norm_ reduces the shards' norms) and every rank takes the optimizer step;
- `model` is always a plain, full, current module in rank 0 (`state_for_push`, checkpoints and
  evaluation read it as at world 1); `optimizer.state_dict()` has world 1's format (FSDP2
  gathers the shards), so a checkpoint resumes at any world size;
- fail fast: start-up is bounded by cluster.rendezvous_timeout_s, each step, gather and load by
  cluster.op_timeout_s (also the gloo timeout of every collective); a rank that dies, is stopped
  (SIGSTOP, where the trainer's machine can see its process) or raises ends the call within about
  a second with an InfrastructureError naming it, after which every rank is killed: no process is
  left behind, and `--resume` continues from the last checkpoint. Ranks also die with the
  trainer (PR_SET_PDEATHSIG locally; Ray ties a placed rank to its driver).
Not guaranteed: bitwise equality with world 1 (float sums run in another order); speed (on
2 cores the ranks share the cores: docs/distributed.md); a stopped rank on another machine is
named only when its collective times out (cluster.op_timeout_s).
A process holds one default process group, so it holds one DataParallelTrainer at a time.
"""

from __future__ import annotations

import atexit
import copy
import io
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from gapless.cluster.ranks import LocalRanks, RankHosts
from gapless.config import ClusterConfig, TrainerConfig
from gapless.errors import InfrastructureError
from gapless.lora import LoraSpec
from gapless.trainer.batch import Batch
from gapless.trainer.corrections import summarise
from gapless.trainer.dp_rank import (
    Crashed,
    Done,
    GatherOptimizer,
    JoinGroup,
    LoadOptimizer,
    RankEngine,
    RankSpec,
    Ready,
    StepShare,
    Stop,
    join_group,
    rank_main,
)
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.trainer import GRPOTrainer, StepStats, Trainer

POLL_S = 0.1


class TrainerRankFailed(InfrastructureError):
    """A data-parallel trainer rank died, stopped, raised or timed out; the run cannot go on."""


# -- rank 0 ----------------------------------------------------------------------------------


def deal_rows(batch: Batch, world_size: int) -> list[list[int]]:
    """Rows of each rank: sorted by length, dealt round-robin (similar token counts per rank)."""
    order = torch.sort(batch.attention_mask.sum(-1), stable=True).indices.tolist()
    return [order[rank::world_size] for rank in range(world_size)]


def loss_free_row(batch: Batch) -> Batch:
    """The batch's shortest row with no loss: a padding pass that computes, reduces, adds nothing."""
    lengths = batch.attention_mask.sum(-1).clamp(min=2)
    row = int(torch.argmin(lengths))
    width = int(lengths[row])
    one = batch.select([row])
    return Batch(
        one.input_ids[:, :width],
        one.attention_mask[:, :width],
        torch.zeros_like(one.loss_mask[:, : width - 1]),
        one.behaviour_logprobs[:, : width - 1],
        torch.zeros_like(one.advantages),
        one.group_ids,
    )


def merge_stats(parts: list[StepStats], correction: str) -> StepStats:
    """One step's stats from each rank's: sums over ranks (each part is already divided by the
    whole step's token count); the gradient norm is global, the same on every rank."""
    offpolicy = [d for p in parts for d in p.offpolicy_parts]
    return StepStats(
        loss=sum(p.loss for p in parts),
        grad_norm=parts[0].grad_norm,
        clip_frac=sum(p.clip_frac for p in parts),
        ratio_mean=sum(p.ratio_mean for p in parts),
        kl_mean=sum(p.kl_mean for p in parts),
        num_tokens=parts[0].num_tokens,
        entropy_mean=sum(p.entropy_mean for p in parts),
        offpolicy=summarise(offpolicy, correction),
        offpolicy_parts=offpolicy,
    )


class _GatheredOptimizer:
    """What checkpoints touch of the optimizer (state_dict / load_state_dict), in world 1's
    format, whatever the wrapping."""

    def __init__(self, owner: "DataParallelTrainer"):
        self._owner = owner

    def state_dict(self) -> dict:
        return self._owner.optimizer_state()

    def load_state_dict(self, state: dict) -> None:
        self._owner.load_optimizer_state(state)


_live: "DataParallelTrainer | None" = None  # the one default process group of this process


@atexit.register
def _close_at_exit() -> None:
    """A trainer nobody closed (a test, a notebook; the run loop closes its own): stop the ranks
    before multiprocessing's own exit handler, which would wait for them forever (they ignore the
    SIGTERM it sends)."""
    if _live is not None:
        _live.close()


class DataParallelTrainer:
    """GRPOTrainer's interface (step, state_for_push, version, optimizer, reference_kl, model)
    over W ranks; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        cluster: ClusterConfig,
        temperature: float = 1.0,
        max_new_tokens: int | None = None,
        hosts: RankHosts | None = None,
    ):
        """`hosts`: where ranks 1..W-1 run (cluster/ranks.py); None: processes on this machine."""
        global _live
        if cfg.loss == "drgrpo" and max_new_tokens is None:
            raise ValueError("trainer.loss = 'drgrpo' divides by generator.max_new_tokens; pass max_new_tokens")
        if _live is not None:
            _live.close()  # an earlier run's trainer in this process (tests, notebooks)
        self.cfg, self.cluster = cfg, cluster
        self.world_size = cluster.trainer_world_size
        self.model = model
        self.version = 0
        self.optimizer = _GatheredOptimizer(self)
        self._closed = False
        self.hosts = hosts if hosts is not None else LocalRanks()
        self._inboxes = {r: self.hosts.channel() for r in range(1, self.world_size)}
        buffer = io.BytesIO()
        torch.save(model, buffer)
        _live = self
        for r in self._inboxes:
            spec = RankSpec(
                r,
                self.world_size,
                cluster.data_parallel,
                cfg,
                temperature,
                max_new_tokens,
                buffer.getvalue(),
                self.hosts.rendezvous,
                cluster.op_timeout_s,
                torch.get_num_threads(),
                os.getpid(),
                self._inboxes[r],
                self.hosts.outbox(r),
            )
            self.hosts.start(r, rank_main, spec)
        self._await(
            lambda: None, Ready, "check in (start, import torch, build the model)", cluster.rendezvous_timeout_s
        )
        self._send(JoinGroup())
        engine_model = model if cluster.data_parallel == "ddp" else copy.deepcopy(model)

        def build() -> None:
            join_group(
                0,
                self.world_size,
                self.hosts.store(self.world_size, cluster.rendezvous_timeout_s),
                cluster.op_timeout_s,
            )
            self._engine = RankEngine(
                engine_model, cluster.data_parallel, self.world_size, cfg, temperature, max_new_tokens
            )

        self._await(build, Ready, "join the process group and wrap the model", cluster.rendezvous_timeout_s)

    # -- GRPOTrainer's interface --

    def step(self, batch: Batch) -> StepStats:
        """Like GRPOTrainer.step, the rows shared over the ranks (module docstring)."""
        norm = StepNorm.of(batch.loss_mask, batch.group_ids, self._engine.trainer.max_new_tokens)
        stats = StepStats(0.0, 0.0, 0.0, 0.0, 0.0, 0)
        if norm.num_tokens > 0:
            rows = deal_rows(batch, self.world_size)
            shares = [batch.select(r) for r in rows]
            count = max(len(s.cut(self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)) for s in shares)
            padding = loss_free_row(batch)
            records = [
                StepShare(s, norm.select(torch.tensor(r, dtype=torch.long)), count, padding)
                for s, r in zip(shares, rows)
            ]
            for rank, inbox in self._inboxes.items():
                inbox.put(records[rank])
            own: list[StepStats] = []

            def train() -> None:
                own.append(self._engine.train(records[0]))
                if self.cluster.data_parallel == "fsdp2":  # refresh the plain model from the shards
                    self.model.load_state_dict(self._engine.full_weights())

            parts = self._await(train, Done, "train its share of the step", self.cluster.op_timeout_s)
            stats = merge_stats(own + [d.stats for d in sorted(parts, key=lambda d: d.rank)], self.cfg.correction)
        self.version += 1
        return stats

    def state_for_push(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def reference_kl(self, batch: Batch) -> list[float]:
        return self._engine.trainer.reference_kl(batch)  # rank 0's full reference copy: no collective

    def optimizer_state(self) -> dict:
        if self.cluster.data_parallel == "ddp":  # every replica holds the same full state
            return self._engine.optimizer_state()
        self._send(GatherOptimizer())
        out: list[dict] = []
        self._await(
            lambda: out.append(self._engine.optimizer_state()),
            Done,
            "gather the optimizer state",
            self.cluster.op_timeout_s,
        )
        return out[0]

    def load_optimizer_state(self, state: dict) -> None:
        self._send(LoadOptimizer(state))
        self._await(
            lambda: self._engine.load_optimizer(state), Done, "load the optimizer state", self.cluster.op_timeout_s
        )

    # -- ranks --

    def _send(self, message) -> None:
        for inbox in self._inboxes.values():
            inbox.put(message)

    def _await(self, own: Callable[[], None], reply: type, what: str, timeout_s: float) -> list:
        """Run rank 0's part `own` on a thread and collect each other rank's `reply`, polling the
        ranks every POLL_S: a dead, stopped or failed rank, or one past `timeout_s`, aborts."""
        if self._closed:
            raise TrainerRankFailed(
                "the data-parallel trainer was closed after a failure; restart the run with --resume"
            )
        error: list[BaseException] = []

        def run() -> None:
            try:
                own()
            except BaseException as exc:  # noqa: BLE001 -- re-raised on the waiting thread
                error.append(exc)

        worker = threading.Thread(target=run, name="gapless-trainer-rank0", daemon=True)
        worker.start()
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while worker.is_alive() or len(replies) < len(self._inboxes):
            worker.join(POLL_S if worker.is_alive() else 0)
            for message in self.hosts.receive(0 if worker.is_alive() else POLL_S):
                if isinstance(message, Crashed):
                    self._fail(
                        f"trainer rank {message.rank} raised while it was to {what}:\n{message.traceback}", worker
                    )
                if isinstance(message, reply):
                    replies[message.rank] = message
            for rank in self._inboxes:
                if (why := self.hosts.check(rank)) is not None:
                    self._fail(f"trainer rank {rank} {why} while it was to {what}", worker)
            if error:
                self._fail(f"trainer rank 0 failed to {what}: {error[0]!r}", worker)
            if time.monotonic() > deadline:
                missing = sorted(set(self._inboxes) - set(replies)) or [0]
                self._fail(
                    f"trainer rank(s) {missing} did not {what} within {timeout_s:g} s "
                    "(cluster.op_timeout_s / cluster.rendezvous_timeout_s)",
                    worker,
                )
        if error:
            self._fail(f"trainer rank 0 failed to {what}: {error[0]!r}", worker)
        return list(replies.values())

    def _fail(self, why: str, worker: threading.Thread | None = None) -> None:
        self.close(kill=True, worker=worker)
        raise TrainerRankFailed(
            f"{why}\nThe trainer's ranks are stopped; fix the cause, then restart with --resume "
            "(the last checkpoint is intact)."
        )

    def close(self, kill: bool = False, worker: threading.Thread | None = None) -> None:
        """Stop every rank (kill at once when `kill`: after a failure) and free the group."""
        global _live
        if self._closed:
            return
        self._closed = True
        if not kill:
            self._send(Stop())
        try:
            self.hosts.close(kill)
            if worker is not None:
                worker.join(timeout=self.cluster.op_timeout_s)  # its collective fails once the peers are gone
            if dist.is_initialized() and (worker is None or not worker.is_alive()):
                dist.destroy_process_group()
        finally:  # a broken group may refuse to be destroyed: the slot is freed anyway
            if _live is self:
                _live = None

    def __enter__(self) -> "DataParallelTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_trainer(
    cfg: TrainerConfig,
    model: torch.nn.Module,
    cluster: ClusterConfig,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    lora: LoraSpec | None = None,
    hosts: RankHosts | None = None,
) -> Trainer:
    """GRPOTrainer at cluster.trainer_world_size 1 (the code path of every single-process run),
    the data-parallel trainer above it, its ranks on `hosts` (None: processes on this machine).
    `lora`: train that adapter (world size 1 only; config/checks.py)."""
    if cluster.trainer_world_size == 1:
        return GRPOTrainer(model, cfg, temperature, max_new_tokens, lora=lora)
    if lora is not None:
        raise ValueError("LoRA trains in one process: cluster.trainer_world_size must be 1")
    return DataParallelTrainer(model, cfg, cluster, temperature, max_new_tokens, hosts)
