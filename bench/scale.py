"""The trainer against rollout length: seconds and peak RSS per step at fixed tokens per step, and
its FLOP/s as a share of the machine's matmul peak measured in the same run.

    PYTHONPATH=src .venv/bin/python bench/scale.py [--lengths 1024,4096,16384,32768]
        [--tokens 32768] [--micro-batch-tokens 4096] [--rounds 2] [--shape tiny] [--threads 2]
        [--gradient-checkpointing]

Workload per length L: tokens / L rows of a 64-token prompt and L - 64 completion tokens, all
trained (random ids; behaviour log-probs from the model itself at its first step, so ratios start
at 1), one GRPO step with the trainer's defaults (dapo, one epoch) and packed micro-batches of
`--micro-batch-tokens` (a longer row trains alone: past that length a micro-batch is one row, so
the activations grow with L while the step's tokens stay the same). `--shape` 'tiny' is the
embedded default model; 'qwen2.5-0.5b' is that shape (151,936-token vocabulary) randomly
initialised, with LoRA rank 8 on every linear layer and gradient checkpointing, where it fits.

Each (round, length) runs in a child process of its own: it builds the model, takes one warm-up
step, then one measured step, and reports the step's seconds and the peak RSS during it (VmHWM
after resetting it; the model, optimizer state and warm-up's pages are already resident).
Rounds alternate the order of the lengths. The matmul peak is the best of three fp32 2048^3
matmuls at the same threads, in the same child, just before the step.

FLOPs of a step (the usual count): 6 x matmul parameters x tokens (the LM head included: it runs
at every trained position) + 6 x layers x hidden x sum over rows of L^2 (causal attention,
forward QK^T and AV, backward twice that). With gradient checkpointing the forward runs twice:
8 instead of 6. Prints one line per run, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = 64


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from gapless.config import TrainerConfig
    from gapless.trainer.batch import Batch
    from gapless.trainer.trainer import GRPOTrainer

    model, lora = build(args.shape)
    length, rows = args.length, max(1, args.tokens // args.length)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    attention = torch.ones_like(ids)
    loss_mask = torch.zeros(rows, length - 1)
    loss_mask[:, PROMPT - 1 :] = 1
    batch = Batch(
        ids,
        attention,
        loss_mask,
        torch.zeros(rows, length - 1),
        torch.randn(rows, generator=g),
        torch.arange(rows) // 2,
    )
    cfg = TrainerConfig(
        max_tokens_per_micro_batch=args.micro_batch_tokens, gradient_checkpointing=args.gradient_checkpointing
    )
    trainer = GRPOTrainer(model, cfg, 1.0, length, lora=lora)
    trainer.step(batch)  # warm-up: AdamW state, allocator pools
    peak_flops = matmul_peak()
    rss_before = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    started = time.perf_counter()
    trainer.step(batch)
    seconds = time.perf_counter() - started
    peak = status_kb("VmHWM")
    flops = step_flops(model, rows, length, args.gradient_checkpointing)
    return {
        "length": length,
        "rows": rows,
        "step_s": seconds,
        "peak_rss_mb": peak / 1024,
        "rss_before_mb": rss_before / 1024,
        "step_rss_mb": (peak - rss_before) / 1024,
        "flops": flops,
        "flop_s": flops / seconds,
        "matmul_peak_flop_s": peak_flops,
        "mfu": flops / seconds / peak_flops,
    }


def build(shape: str):
    import torch

    from gapless.config import ModelConfig
    from gapless.models import build_tiny

    if shape == "tiny":
        return build_tiny(ModelConfig(), ["12 + 34 = 46; 7 * 8 = 56; (3 - 1) * 2 = 4"] * 16, seed=0).model, None
    import transformers

    from gapless.lora import LoraSpec

    config = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768 + 512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spec = LoraSpec(
        rank=8,
        alpha=32,
        seed=0,
        dropout=0.0,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    return model, spec


def step_flops(model, rows: int, length: int, checkpointing: bool) -> float:
    import torch

    c = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if getattr(c, "tie_word_embeddings", False) and not any(
        m.weight is model.get_input_embeddings().weight for m in model.modules() if isinstance(m, torch.nn.Linear)
    ):
        matmul += model.get_input_embeddings().weight.numel()
    factor = 8 if checkpointing else 6
    hidden = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return factor * matmul * rows * length + factor * c.num_hidden_layers * hidden * rows * length**2


def matmul_peak() -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * 2048**3 / best


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,4096,16384,32768")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shape", default="tiny", choices=["tiny", "qwen2.5-0.5b"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)  # the child's one length
    args = p.parse_args()
    if args.length:
        print(json.dumps(child(args)))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in lengths}
    for r in range(args.rounds):
        for n in lengths if r % 2 == 0 else lengths[::-1]:
            cmd = [
                sys.executable,
                __file__,
                "--length",
                str(n),
                "--tokens",
                str(args.tokens),
                "--shape",
                args.shape,
                "--micro-batch-tokens",
                str(args.micro_batch_tokens),
                "--threads",
                str(args.threads),
            ]
            cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
            out = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            )
            if out.returncode != 0:
                print(f"round {r} length {n}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            runs[n].append(rec)
            print(
                f"round {r} length {n:>6} rows {rec['rows']:>3}  step {rec['step_s']:8.2f} s  step RSS +{rec['step_rss_mb']:7.0f} MB "
                f"(peak {rec['peak_rss_mb']:.0f})  {rec['flop_s'] / 1e9:6.1f} GFLOP/s = {rec['mfu']:.2f} of matmul peak "
                f"{rec['matmul_peak_flop_s'] / 1e9:.1f}",
                flush=True,
            )
    summary = {}
    for n, recs in runs.items():
        if recs:
            summary[n] = {
                k: {
                    "median": statistics.median(x[k] for x in recs),
                    "min": min(x[k] for x in recs),
                    "max": max(x[k] for x in recs),
                }
                for k in ("step_s", "step_rss_mb", "peak_rss_mb", "mfu", "flop_s")
            }
    print(
        json.dumps(
            {
                "shape": args.shape,
                "tokens": args.tokens,
                "micro_batch_tokens": args.micro_batch_tokens,
                "threads": args.threads,
                "rounds": args.rounds,
                "by_length": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
