"""One data-parallel trainer rank: the records it exchanges with rank 0, and what it runs.

Every rank, rank 0 included, holds a `RankEngine`: the world-1 GRPOTrainer over its wrapped
model (a DDP replica or an FSDP2 shard), so the GRPO step itself is the same code at every world
size. Ranks 1..W-1 run `rank_main` in a process of their own (a spawned one, or a Ray actor:
cluster/ranks.py) and serve rank 0's records in order:

    check in (Ready) ─> JoinGroup: join the gloo group, wrap ─> Ready
    StepShare ─> train the rows (FSDP2: then join the full-weight gather) ─> Done(stats)
    GatherOptimizer / LoadOptimizer ─> Done          Stop ─> leave the group, exit
    any exception ─> Crashed(traceback), exit

Guaranteed: a rank runs exactly the collectives rank 0 runs, in the same order (the records
say which, and `ShardPlan` fixes the pass count); it dies with the trainer process
(PR_SET_PDEATHSIG; Ray ties a placed rank to its driver) and ignores the SIGINT/SIGTERM sent to
the process group (the trainer decides when the ranks stop). Not guaranteed: anything past
`cluster.op_timeout_s` per collective, which is gloo's own bound.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import io
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gapless.cluster.ranks import Rendezvous
from gapless.config import TrainerConfig
from gapless.trainer.batch import Batch
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.trainer import GRPOTrainer, ShardPlan, StepStats

# -- messages (rank 0 -> rank r through its inbox; rank r -> rank 0 through the shared outbox) --


@dataclass(frozen=True)
class JoinGroup:
    """Every rank has checked in: build the process group and wrap the model."""


@dataclass(frozen=True)
class StepShare:
    batch: Batch  # this rank's rows of the step (possibly none)
    norm: StepNorm  # the whole step's counts, selected to these rows
    num_micro_batches: int  # the same on every rank
    padding: Batch  # one loss-free row for the passes this rank has no rows for


@dataclass(frozen=True)
class LoadOptimizer:
    state: dict  # world 1's optimizer.state_dict() format


@dataclass(frozen=True)
class GatherOptimizer:
    """FSDP2: join the all-gather of the optimizer state's shards."""


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int = 0  # the rank's process, on `host` (its placement may not know it otherwise)
    host: str = ""


@dataclass(frozen=True)
class Done:
    rank: int
    stats: StepStats | None = None


@dataclass(frozen=True)
class Crashed:
    rank: int
    traceback: str


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs; picklable."""

    rank: int
    world_size: int
    data_parallel: str
    trainer: TrainerConfig
    temperature: float
    max_new_tokens: int | None
    model_bytes: bytes  # torch.save of the module: every rank starts from rank 0's weights
    rendezvous: Rendezvous
    op_timeout_s: float
    threads: int
    trainer_pid: int  # 0: not the trainer's child (a Ray actor: Ray ties its life to the trainer)
    inbox: Any
    outbox: Any


# -- what every rank runs --------------------------------------------------------------------


class RankEngine:
    """One rank's GRPOTrainer over its wrapped model (DDP replica or FSDP2 shard)."""

    def __init__(
        self,
        model: torch.nn.Module,
        data_parallel: str,
        world_size: int,
        cfg: TrainerConfig,
        temperature: float,
        max_new_tokens: int | None,
    ):
        self.data_parallel, self.world_size = data_parallel, world_size
        wrap = _wrap_ddp if data_parallel == "ddp" else _wrap_fsdp2
        self.trainer = GRPOTrainer(model, cfg, temperature, max_new_tokens, wrap=wrap)

    def train(self, share: StepShare) -> StepStats:
        plan = ShardPlan(share.num_micro_batches, share.padding, float(self.world_size), self._no_sync)
        return self.trainer.update(share.batch, share.norm, plan)

    def _no_sync(self) -> contextlib.AbstractContextManager:
        model = self.trainer.model
        if self.data_parallel == "ddp":
            return model.no_sync()
        return _fsdp_no_sync(model)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """FSDP2: the full state dict, gathered (a collective: every rank calls it, in order)."""
        return {name: _full(value) for name, value in self.trainer.model.state_dict().items()}

    def optimizer_state(self) -> dict:
        """World 1's optimizer.state_dict() format; FSDP2 gathers every shard (a collective)."""
        optimizer = self.trainer.optimizer
        params = list(self.trainer.model.parameters())
        state = {
            i: {key: _full(value) for key, value in sorted(optimizer.state[p].items())}
            for i, p in enumerate(params)
            if p in optimizer.state
        }
        return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}

    def load_optimizer(self, state: dict) -> None:
        """Each rank keeps its own shard of world 1's format (no communication). A copy: the
        optimizer updates its state in place, and `state` may be another optimizer's."""
        state = copy.deepcopy(state)
        if self.data_parallel == "fsdp2":
            from torch.distributed.tensor import DTensor, distribute_tensor

            params = list(self.trainer.model.parameters())
            sharded = {}
            for i, values in state["state"].items():
                p = params[int(i)]
                sharded[i] = {
                    key: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape
                    else v
                    for key, v in values.items()
                }
            state = {"state": sharded, "param_groups": state["param_groups"]}
        self.trainer.optimizer.load_state_dict(state)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _wrap_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard each transformer block (the classes a HF model names in `_no_split_modules`),
    then the root, which keeps the rest (embeddings, tied head, final norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def join_group(rank: int, world_size: int, store, op_timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=op_timeout_s)
    )


def rank_main(spec: RankSpec) -> None:
    """Entry point of ranks 1..W-1: check in, join the group, then serve rank 0's records."""
    _die_with_parent(spec.rank, spec.trainer_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer alone decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        torch.set_num_threads(spec.threads)
        model = torch.load(io.BytesIO(spec.model_bytes), weights_only=False)
        spec.outbox.put(Ready(spec.rank, os.getpid(), socket.gethostname()))
        message = spec.inbox.get()
        if isinstance(message, Stop):
            return
        join_group(
            spec.rank, spec.world_size, spec.rendezvous.client(spec.world_size, spec.op_timeout_s), spec.op_timeout_s
        )
        engine = RankEngine(
            model, spec.data_parallel, spec.world_size, spec.trainer, spec.temperature, spec.max_new_tokens
        )
        spec.outbox.put(Ready(spec.rank))
        while not isinstance(message := spec.inbox.get(), Stop):
            if isinstance(message, StepShare):
                stats = engine.train(message)
                if engine.data_parallel == "fsdp2":
                    engine.full_weights()
                spec.outbox.put(Done(spec.rank, stats))
            elif isinstance(message, GatherOptimizer):
                engine.optimizer_state()
                spec.outbox.put(Done(spec.rank))
            elif isinstance(message, LoadOptimizer):
                engine.load_optimizer(message.state)
                spec.outbox.put(Done(spec.rank))
        dist.destroy_process_group()
    except Exception:
        spec.outbox.put(Crashed(spec.rank, traceback.format_exc()))
        raise


def _die_with_parent(rank: int, trainer_pid: int) -> None:
    """Name this rank `gapless-rank<r>` (what `ps -o comm` and /proc/PID/comm show); when it is
    the trainer's child, SIGKILL it when the trainer dies (exit if it already has)."""
    PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, f"gapless-rank{rank}".encode())
    if trainer_pid == 0:
        return
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != trainer_pid:
        os._exit(1)
