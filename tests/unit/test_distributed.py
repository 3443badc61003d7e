"""Trainer data parallel (gloo, 2 ranks on this machine) against the world-1 trainer: one step
gives the same weights, loss, gradient norm and optimizer state; a rank that dies or stops ends
the next call within 2 s with an error naming it, and no rank process is left behind.

Each test spawns one world-2 trainer (the spawn and torch import dominate its time) and checks
several properties on it."""

import copy
import os
import signal
import subprocess
import time

import pytest
import torch

from gapless.cluster.watchdog import process_state
from gapless.config import ClusterConfig, ConfigError, TrainerConfig, load_config
from gapless.generate.sampler import TorchSampler
from gapless.trainer.batch import build_batch
from gapless.trainer.distributed import DataParallelTrainer, TrainerRankFailed, deal_rows, make_trainer
from gapless.trainer.trainer import GRPOTrainer, StepStats, Trainer
from gapless.types import SamplingParams

MAX_NEW_TOKENS = 10
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def sampled(tiny_policy, problems):
    """9 rows the tiny policy sampled (3 prompts, groups of 3), one an infrastructure failure:
    2 ranks get 5 and 4 rows, at micro_batch_size 2 that is 3 and 2 passes (one padded)."""
    model = copy.deepcopy(tiny_policy.model)
    sampler = TorchSampler(model, tiny_policy.eos_id, tiny_policy.pad_id)
    prompts = [tiny_policy.encode(p.prompt) for p in problems[:3] for _ in range(3)]
    completions = sampler.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=MAX_NEW_TOKENS, seed=5))
    advantages = torch.randn(len(completions), generator=torch.Generator().manual_seed(0)).tolist()
    batch = build_batch(
        completions, advantages, [i != 4 for i in range(9)], tiny_policy.pad_id, [i // 3 for i in range(9)]
    )
    return model, batch


def max_abs_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def optimizer_difference(a: dict, b: dict) -> float:
    assert a["state"].keys() == b["state"].keys() and a["param_groups"] == b["param_groups"]
    return max(float((a["state"][i][k] - b["state"][i][k]).abs().max()) for i in a["state"] for k in a["state"][i])


def assert_same_step(world_1: GRPOTrainer, world_2: DataParallelTrainer, batch) -> StepStats:
    one, two = world_1.step(batch), world_2.step(batch)
    assert two.num_tokens == one.num_tokens == batch.num_tokens
    assert two.loss == pytest.approx(one.loss, abs=TOLERANCE)
    assert two.grad_norm == pytest.approx(one.grad_norm, abs=TOLERANCE) and one.grad_norm > 0
    for name in ("clip_frac", "ratio_mean", "kl_mean", "entropy_mean"):
        assert getattr(two, name) == pytest.approx(getattr(one, name), abs=TOLERANCE), name
    assert two.offpolicy == pytest.approx(one.offpolicy, abs=TOLERANCE)
    assert max_abs_difference(world_1.state_for_push(), world_2.state_for_push()) < TOLERANCE
    assert optimizer_difference(world_1.optimizer.state_dict(), world_2.optimizer.state_dict()) < TOLERANCE
    assert world_2.version == world_1.version
    return two


def fails_within(trainer: DataParallelTrainer, batch, rank: int) -> float:
    started = time.monotonic()
    with pytest.raises(TrainerRankFailed, match=f"rank {rank}"):
        trainer.step(batch)
    return time.monotonic() - started


def assert_no_rank_left(pids: list[int]) -> None:
    for pid in pids:
        assert process_state(pid) == "gone", f"rank process {pid} left behind: {process_state(pid)}"


def test_deal_rows_covers_every_row_once_with_similar_token_counts(sampled):
    _, batch = sampled
    rows = deal_rows(batch, 2)
    assert sorted(rows[0] + rows[1]) == list(range(len(batch))) and [len(r) for r in rows] == [5, 4]
    lengths = batch.attention_mask.sum(-1)
    assert abs(int(lengths[rows[0]].sum()) - int(lengths[rows[1]].sum())) <= int(lengths.max())


def test_world_1_is_the_plain_trainer(sampled):
    trainer = make_trainer(TrainerConfig(), copy.deepcopy(sampled[0]), ClusterConfig(), 0.7, MAX_NEW_TOKENS)
    assert type(trainer) is GRPOTrainer


@pytest.mark.slow  # spawning a rank and importing torch there: ~15-35 s on 2 busy cores
def test_ddp_world_2_equals_world_1_and_a_killed_rank_is_named(sampled):
    """Uneven split, two epochs and a KL term in the loss; then rank 1 is killed."""
    model, batch = sampled
    cfg = TrainerConfig(micro_batch_size=2, epochs=2, kl_coef=0.05, entropy_coef=0.01)
    world_1 = GRPOTrainer(copy.deepcopy(model), cfg, 0.7, MAX_NEW_TOKENS)
    world_2 = DataParallelTrainer(
        copy.deepcopy(model), cfg, ClusterConfig(trainer_world_size=2, op_timeout_s=30), 0.7, MAX_NEW_TOKENS
    )
    pids = list(world_2.hosts.pids().values())
    try:
        assert_same_step(world_1, world_2, batch)
        assert world_2.reference_kl(batch) == pytest.approx(world_1.reference_kl(batch), abs=TOLERANCE)
        os.kill(pids[0], signal.SIGKILL)
        assert fails_within(world_2, batch, rank=1) < 2.0
        assert_no_rank_left(pids)
        with pytest.raises(TrainerRankFailed, match="--resume"):
            world_2.step(batch)  # a failed trainer stays failed
    finally:
        world_2.close()
    assert_no_rank_left(pids)
    assert not os.path.exists(world_2.hosts.store_dir)


@pytest.mark.slow
def test_fsdp2_world_2_equals_world_1_resumes_optimizer_state_and_a_stopped_rank_is_named(sampled):
    """GRPO's per-sequence normaliser, trainer old log-probs with a correction; the optimizer state
    round-trips through world 1's format (what checkpoints store); then rank 1 is stopped."""
    model, batch = sampled
    cfg = TrainerConfig(micro_batch_size=2, loss="grpo", old_logprobs="trainer", correction="tis")
    world_1 = GRPOTrainer(copy.deepcopy(model), cfg, 0.7, MAX_NEW_TOKENS)
    cluster = ClusterConfig(trainer_world_size=2, data_parallel="fsdp2", op_timeout_s=30)
    world_2 = DataParallelTrainer(copy.deepcopy(model), cfg, cluster, 0.7, MAX_NEW_TOKENS)
    pids = list(world_2.hosts.pids().values())
    try:
        assert_same_step(world_1, world_2, batch)
        world_2.load_optimizer_state(world_1.optimizer.state_dict())  # as --resume does
        assert optimizer_difference(world_1.optimizer.state_dict(), world_2.optimizer.state_dict()) == 0.0
        assert_same_step(world_1, world_2, batch)
        os.kill(pids[0], signal.SIGSTOP)
        assert fails_within(world_2, batch, rank=1) < 2.0
    finally:
        world_2.close(kill=True)
    assert_no_rank_left(pids)
    assert not os.path.exists(world_2.hosts.store_dir)


def test_cluster_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="cluster.trainer_world_size"):
        load_config(None, {"cluster.trainer_world_size": "0"})
    with pytest.raises(ConfigError, match="cluster.op_timeout_s .* cluster.rendezvous_timeout_s"):
        load_config(
            None,
            {"cluster.trainer_world_size": "2", "cluster.op_timeout_s": "600", "cluster.rendezvous_timeout_s": "60"},
        )
    with pytest.raises(ConfigError, match="cluster.data_parallel"):
        load_config(None, {"cluster.data_parallel": "'zero3'"})
    cores = os.cpu_count()
    with pytest.warns(UserWarning, match=f"exceeds the {cores} cores"):
        assert load_config(None, {"cluster.trainer_world_size": str(cores + 1)}).cluster.trainer_world_size == cores + 1


@pytest.mark.parametrize(
    "placement", ["world_1", pytest.param("ddp", marks=pytest.mark.slow), pytest.param("fsdp2", marks=pytest.mark.slow)]
)
def test_trainer_contract(sampled, placement):
    """What the run loop touches, on every implementation of the Trainer protocol."""
    model, batch = sampled
    cfg = TrainerConfig(micro_batch_size=4, kl_coef=0.05, lr=1e-2)
    cluster = (
        ClusterConfig() if placement == "world_1" else ClusterConfig(trainer_world_size=2, data_parallel=placement)
    )
    trainer = make_trainer(cfg, copy.deepcopy(model), cluster, 0.7, MAX_NEW_TOKENS)
    try:
        assert isinstance(trainer, Trainer)
        before = {k: v.clone() for k, v in trainer.state_for_push().items()}
        assert before.keys() == model.state_dict().keys()
        stats = trainer.step(batch.select([4]))  # the infrastructure failure alone: no loss token
        assert stats.num_tokens == 0 and trainer.version == 1
        assert all(torch.equal(before[k], v) for k, v in trainer.state_for_push().items())
        stats = trainer.step(batch)
        assert stats.num_tokens == batch.num_tokens and trainer.version == 2
        after = trainer.state_for_push()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert all(torch.equal(after[k], v) for k, v in trainer.model.state_dict().items())  # `model` is current
        state = trainer.optimizer.state_dict()
        assert len(state["param_groups"]) == 1 and len(state["state"]) == len(list(model.parameters()))
        trainer.optimizer.load_state_dict(state)
        assert optimizer_difference(state, trainer.optimizer.state_dict()) == 0.0
        assert len(trainer.reference_kl(batch)) == len(batch)
        trainer.version = 7  # as --resume sets it
        trainer.step(batch)
        assert trainer.version == 8
    finally:
        if placement != "world_1":
            trainer.close()


@pytest.mark.slow  # a private Ray instance (~10 s) and a placed rank that imports torch
def test_ranks_placed_on_ray_equal_local_ranks_bitwise_and_a_killed_rank_is_named(sampled, tmp_path):
    """The same rank code as a Ray actor on its own bundle of the run's placement group: one DDP
    step equals world 1's within 1e-6 and the local ranks' step bitwise (weights, optimizer state,
    loss); a rank killed with SIGKILL ends the next step within 2 s with an error naming it; the
    placement's teardown leaves no Ray process."""
    pytest.importorskip("ray")
    from gapless.cluster import make_placement

    def ray_processes(marker: str) -> list[str]:
        out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
        return [line for line in out if marker in line and "ps -eo" not in line]

    model, batch = sampled
    trainer_cfg = TrainerConfig(micro_batch_size=2, epochs=2, kl_coef=0.05, entropy_coef=0.01)
    cfg = load_config(
        None,
        {
            "cluster.placement": '"ray"',
            "cluster.trainer_world_size": "2",
            "cluster.op_timeout_s": "30",
            "pipeline.generator_threads": "1",
            "trainer.threads": "1",
            "cluster.object_store_mb": "100",
            "run_dir": repr(str(tmp_path)),
        },
    )
    with DataParallelTrainer(copy.deepcopy(model), trainer_cfg, cfg.cluster, 0.7, MAX_NEW_TOKENS) as local:
        local_stats = local.step(batch)
        local_weights, local_optimizer = local.state_for_push(), local.optimizer.state_dict()
    placement = make_placement(cfg)
    temp_dir = placement.temp_dir
    try:
        placement.reserve({})
        hosts = placement.trainer_ranks()
        world_1 = GRPOTrainer(copy.deepcopy(model), trainer_cfg, 0.7, MAX_NEW_TOKENS)
        placed = make_trainer(trainer_cfg, copy.deepcopy(model), cfg.cluster, 0.7, MAX_NEW_TOKENS, hosts=hosts)
        assert isinstance(placed, DataParallelTrainer) and placed.hosts.kind == "ray"
        stats = assert_same_step(world_1, placed, batch)
        assert stats.loss == local_stats.loss and stats.grad_norm == local_stats.grad_norm
        assert max_abs_difference(local_weights, placed.state_for_push()) == 0.0
        assert optimizer_difference(local_optimizer, placed.optimizer.state_dict()) == 0.0
        pid = hosts.pids()[1]
        assert pid != os.getpid() and process_state(pid) != "gone"
        os.kill(pid, signal.SIGKILL)
        assert fails_within(placed, batch, rank=1) < 2.0
    finally:
        placement.shutdown(None, 0.0)
    deadline = time.monotonic() + 15
    while ray_processes(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(temp_dir)
