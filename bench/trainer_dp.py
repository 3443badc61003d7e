"""Trainer data parallel: seconds per step at world 1 against world 2 (DDP, then FSDP2), in one run.

The workload is the default job's step: the embedded model (model.* defaults), 16 prompts x 8
samples = 128 rows of a ~40-token prompt plus 24 sampled tokens, behaviour log-probs from the
model itself (ratios 1), trainer defaults (micro_batch_size 64, one epoch). Per wrapping, one
world-2 trainer (ranks at `--threads` torch threads each) runs side by side with two world-1
trainers, interleaved round by round: world 1 at the same threads per rank, and world 1 at
W x threads (the same cores as the whole world-2 trainer). The weights are compared after the
first step and after the rounds; then rank 1 is killed (DDP) or stopped (FSDP2) and the time
until the next step raises is measured. A process holds one default process group, hence one
wrapping at a time.

On a 2-core machine expect no speed-up at equal cores: the ranks split the same two cores that
world 1's threads already use, and add a gradient all-reduce (DDP) or per-layer weight gathers
and gradient reduce-scatters (FSDP2) over loopback gloo, plus the hand-off of each rank's share.
At equal threads per rank, world 2 uses twice the cores and can approach 2x only on an idle box.

    PYTHONPATH=src python bench/trainer_dp.py [--rounds 5] [--threads 1]

Prints one line per round, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import time

import torch

from gapless.config import ClusterConfig, ModelConfig, TrainerConfig
from gapless.envs.code.problems import generate_problems
from gapless.models import build_tiny
from gapless.trainer.batch import Batch, token_logprobs
from gapless.trainer.distributed import DataParallelTrainer, TrainerRankFailed
from gapless.trainer.trainer import GRPOTrainer

PROMPT_TOKENS, NEW_TOKENS, ROWS, GROUP = 40, 24, 128, 8


def default_step_batch(model: torch.nn.Module, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    new = torch.randint(NEW_TOKENS // 2, NEW_TOKENS + 1, (ROWS,), generator=g)  # completion lengths
    width = PROMPT_TOKENS + NEW_TOKENS
    input_ids = torch.randint(2, vocab, (ROWS, width), generator=g)
    attention_mask = (torch.arange(width)[None, :] < (PROMPT_TOKENS + new)[:, None]).long()
    positions = torch.arange(width - 1)[None, :]
    loss_mask = ((positions >= PROMPT_TOKENS - 1) & (positions < PROMPT_TOKENS - 1 + new[:, None])).float()
    with torch.no_grad():
        behaviour = token_logprobs(model, input_ids, attention_mask) * loss_mask
    advantages = torch.randn(ROWS, generator=g)
    return Batch(input_ids, attention_mask, loss_mask, behaviour, advantages, torch.arange(ROWS) // GROUP)


def timed_step(trainer, batch: Batch, threads: int) -> float:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    trainer.step(batch)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    args = parser.parse_args()
    world = 2
    problems = generate_problems(0, "train", 64, [1, 2, 3])
    torch.manual_seed(0)
    policy = build_tiny(ModelConfig(), [p.prompt + p.solution for p in problems], seed=0)
    batch = default_step_batch(policy.model, len(policy.tokenizer))
    cfg = TrainerConfig()
    result = {
        "cores": os.cpu_count(),
        "threads_per_rank": args.threads,
        "world_size": world,
        "rows": ROWS,
        "parameters": sum(p.numel() for p in policy.model.parameters()),
        "rounds": args.rounds,
    }
    for kind in ("ddp", "fsdp2"):
        torch.set_num_threads(args.threads)  # the spawned rank takes the thread count at start
        dp = DataParallelTrainer(
            copy.deepcopy(policy.model), cfg, ClusterConfig(trainer_world_size=world, data_parallel=kind)
        )
        same_threads = GRPOTrainer(copy.deepcopy(policy.model), cfg)
        same_cores = GRPOTrainer(copy.deepcopy(policy.model), cfg)
        times: dict[str, list[float]] = {"world_2": [], "world_1_same_threads": [], "world_1_same_cores": []}
        fault = signal.SIGKILL if kind == "ddp" else signal.SIGSTOP
        detect_s, named = float("nan"), False  # stays so if the step after the fault does not raise
        try:
            timed_step(dp, batch, args.threads)  # warm-up: first-touch allocations, FSDP2's lazy init
            timed_step(same_threads, batch, args.threads)
            timed_step(same_cores, batch, world * args.threads)
            one, two = same_threads.state_for_push(), dp.state_for_push()
            one_step_dw = max(float((one[k] - two[k]).abs().max()) for k in one)
            for round_ in range(args.rounds):
                times["world_2"].append(timed_step(dp, batch, args.threads))
                times["world_1_same_threads"].append(timed_step(same_threads, batch, args.threads))
                times["world_1_same_cores"].append(timed_step(same_cores, batch, world * args.threads))
                print(kind, round_, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
            one, two = same_threads.state_for_push(), dp.state_for_push()
            max_dw = max(float((one[k] - two[k]).abs().max()) for k in one)
            os.kill(dp.hosts.pids()[1], fault)
            started = time.perf_counter()
            try:
                dp.step(batch)
            except TrainerRankFailed as exc:
                detect_s, named = time.perf_counter() - started, "trainer rank 1" in str(exc)
        finally:
            dp.close(kill=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        result[kind] = {
            **{f"{k}_s_per_step": round(v, 4) for k, v in med.items()},
            "speedup_vs_same_cores": round(med["world_1_same_cores"] / med["world_2"], 3),
            "speedup_vs_same_threads": round(med["world_1_same_threads"] / med["world_2"], 3),
            "max_abs_dw_one_step": one_step_dw,
            "max_abs_dw_after_rounds": max_dw,
            f"{fault.name}_rank_1_detected_s": round(detect_s, 3),
            "error_names_rank": named,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
