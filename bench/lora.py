"""LoRA on real model shapes: what a weight push carries, what it costs, and one LoRA RL step.

Models: bench/real_shapes.py's randomly initialised Qwen2.5-0.5B and Qwen3-0.6B shapes (true
vocabularies, tied embeddings), built in memory, nothing downloaded, no run started.
Phases (each in its own child process, so peak resident memory is its own):
  push      the trainer's push at rank R (default 8, the default `lora.target_modules`: every
            attention and MLP projection) against the full model's: bytes and their ratio, and,
            side by side on the same weights, the seconds of one `SharedWeights.publish` of each
            plus the generator's merge of the adapters into a `TorchEngine`
            (`generate/adapters.py`) against its load of full weights
  rl_step   (--rl-step) one LoRA GRPO step of gapless's trainer on S completions of P + G random
            tokens (bench/real_shapes.py's workload): seconds and peak resident memory (VmHWM)
Prints one line per phase, then one JSON object on the last line.

    PYTHONPATH=src python bench/lora.py [--shapes qwen2.5-0.5b] [--rank 8] [--threads 2] [--rl-step]
        [--micro-batch-size 64] [--gradient-checkpointing]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_shapes import build_model, peak_rss_gb, prompts  # noqa: E402  (bench/real_shapes.py)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # lora.target_modules' default


def _bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def push(model, args) -> dict:
    import torch

    from gapless.cluster.weights import SharedWeights
    from gapless.config import TrainerConfig
    from gapless.generate.adapters import AdapterMerge
    from gapless.generate.engine import TorchEngine
    from gapless.lora import LoraSpec
    from gapless.trainer.trainer import GRPOTrainer

    full = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: pushed once
    spec = LoraSpec(rank=args.rank, seed=0, target_modules=TARGETS)
    trainer = GRPOTrainer(model, TrainerConfig(), 1.0, args.new_tokens, lora=spec)
    with torch.no_grad():  # a trained adapter, not B = 0 (the merge's work is the same either way)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    adapters = trainer.state_for_push()
    out = {"rank": args.rank, "full_bytes": _bytes(full), "push_bytes": _bytes(adapters)}
    out["push_ratio"] = out["push_bytes"] / out["full_bytes"]
    for kind, state in (("full", full), ("lora", adapters)):
        weights = SharedWeights(state, 0)
        started = time.perf_counter()
        weights.publish(state, 1)
        out[f"publish_{kind}_s"] = time.perf_counter() - started
        del weights
    engine = TorchEngine(model, eos_id=0, max_batch=2, max_seq_len=64)
    started = time.perf_counter()
    engine.update_weights(full, 1)
    out["load_full_s"] = time.perf_counter() - started
    engine.adapters = AdapterMerge(model, spec)
    started = time.perf_counter()
    engine.update_weights(adapters, 2)
    out["merge_lora_s"] = time.perf_counter() - started
    return out


def rl_step(model, args) -> dict:
    """One LoRA optimizer step of gapless's GRPO trainer (real_shapes.py's rl_step, with `lora`)."""
    import torch

    from gapless.config import TrainerConfig
    from gapless.lora import LoraSpec
    from gapless.trainer.batch import build_batch, token_logprobs
    from gapless.trainer.trainer import GRPOTrainer
    from gapless.types import Completion

    rows = prompts(args)
    gen = torch.Generator().manual_seed(2)
    completions = [
        Completion(
            r,
            torch.randint(1000, 4000, (args.new_tokens,), generator=gen).tolist(),
            [0.0] * args.new_tokens,
            [0] * args.new_tokens,
            "length",
            "",
        )
        for r in rows
    ]
    batch = build_batch(completions, [(-1.0) ** i for i in range(len(rows))], [True] * len(rows), 0)
    with torch.no_grad():  # behaviour log-probs = the current policy's: ratios 1, as at zero staleness
        for start in range(0, len(rows), args.micro_batch_size):  # in micro-batches, as the step itself runs
            rows_ = slice(start, start + args.micro_batch_size)
            batch.behaviour_logprobs[rows_] = (
                token_logprobs(model, batch.input_ids[rows_], batch.attention_mask[rows_]) * batch.loss_mask[rows_]
            )
    cfg = TrainerConfig(
        lr=1e-4, micro_batch_size=args.micro_batch_size, gradient_checkpointing=args.gradient_checkpointing
    )
    trainer = GRPOTrainer(
        model, cfg, 1.0, args.new_tokens, lora=LoraSpec(rank=args.rank, seed=0, target_modules=TARGETS)
    )
    started = time.perf_counter()
    stats = trainer.step(batch)
    return {
        "step_s": time.perf_counter() - started,
        "num_tokens": stats.num_tokens,
        "trained_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = build_model(args.shape)
    out = {
        "phase": args.phase,
        "shape": args.shape,
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": time.perf_counter() - started,
    }
    out.update(push(model, args) if args.phase == "push" else rl_step(model, args))
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rl-step", action="store_true", help="also one LoRA RL step per shape")
    ap.add_argument("--micro-batch-size", type=int, default=64, help="trainer.micro_batch_size of the RL step")
    ap.add_argument(
        "--gradient-checkpointing", action="store_true", help="trainer.gradient_checkpointing in the RL step"
    )
    ap.add_argument("--phases", default=None, help="comma-separated subset of push, rl_step")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(child(args)))
        return
    phases = args.phases.split(",") if args.phases else ["push"] + (["rl_step"] if args.rl_step else [])
    results: dict[str, dict] = {}
    for shape in args.shapes.split(","):
        results[shape] = {}
        for phase in phases:
            cmd = [
                sys.executable,
                __file__,
                "--phase",
                phase,
                "--shape",
                shape,
                "--threads",
                str(args.threads),
                "--rank",
                str(args.rank),
                "--sequences",
                str(args.sequences),
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--new-tokens",
                str(args.new_tokens),
                "--micro-batch-size",
                str(args.micro_batch_size),
            ]
            cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                results[shape][phase] = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
            else:
                results[shape][phase] = json.loads(lines[-1])
            print(shape, phase, json.dumps(results[shape][phase]), flush=True)
    print(
        json.dumps(
            {
                "rank": args.rank,
                "threads": args.threads,
                "micro_batch_size": args.micro_batch_size,
                "gradient_checkpointing": args.gradient_checkpointing,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
