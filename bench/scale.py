"""The trainer against rollout length and against TRL, in interleaved rounds:
(a) seconds and peak RSS per step at fixed tokens per step, rollouts of 1K-32K tokens;
(b) the trainer's FLOP/s as a share of the machine's matmul peak measured in the same child;
(c) gapless's synchronous s/step against TRL's `GRPOTrainer` on the same work (bench/vs_trl.py's).

    PYTHONPATH=src .venv/bin/python bench/scale.py [--rounds 3]
        [--lengths 1024,4096,16384,32768] [--tokens 32768] [--micro-batch-tokens 4096]
        [--big-lengths 1024,4096] [--big-tokens 4096] [--trl-steps 3] [--threads 2]
    (--big-lengths '' or --trl-steps 0 leave a part out)

(a, b) Workload per length L: tokens / L rows of a 64-token prompt and L - 64 completion tokens,
all trained (random ids; behaviour log-probs 0), one GRPO step with the trainer's defaults (dapo,
one epoch) and packed micro-batches of `--micro-batch-tokens` (a longer row trains alone: past
that length a micro-batch is one row, so the activations grow with L while the step's tokens
stay the same). Two shapes: 'tiny', the embedded default model, full fine-tuning, at `--tokens`
per step; 'qwen2.5-0.5b', that shape (151,936-token vocabulary) randomly initialised, LoRA rank
8 on every linear layer and gradient checkpointing, at `--big-tokens` per step (a 0.5B step costs
about 3 GFLOP a token on this path: 32K-token steps do not fit a benchmark's time box on 2 cores).

Each (round, shape, length) runs in a child process of its own: it builds the model, takes one
warm-up step (the tiny shape on the same batch; the 0.5B shape on one 256-token row, to keep the
run short: its AdamW state is the adapters', small), times the matmul peak, then one measured
step: its seconds and the peak RSS during it (VmHWM reset just before; the model, optimizer
state and warm-up's pages already resident). The matmul peak is the best of three fp32 2048^3
matmuls at the same threads.

FLOPs of a step, those the step executes: forward 2 x matmul parameters x tokens (the LM head
included: it runs at every trained position); backward 2x that for the inputs' gradients plus
2x for the weights' gradients, the latter only where weights train (full: 6 in all; LoRA: 4,
the adapters' own being negligible); causal attention 2 x layers x hidden x sum over rows of L^2
forward (QK^T and AV, half the square) and twice that backward; gradient checkpointing runs the
forward once more. MFU here is those FLOPs over the step's seconds over the matmul peak; the
same per CPU second of the process (`mfu_cpu`: FLOPs over the step's process CPU time over the
matmul's FLOPs per CPU second), which a shared machine's other tenants move less: with one
thread, a preempted process accrues no CPU time (with two, spin-waiting at barriers does).

(c) bench/vs_trl.py's workload (16 prompts x 8 samples of at most 24 tokens, the tiny model
random-initialised, the sandboxed code environment; its docstring lists what is aligned), one
child per side per round, `--trl-warmup` + `--trl-steps` steps each, the sides alternating first;
seconds per step and process CPU seconds per step (all threads; the sandbox's own processes not
counted on either side).
Needs bench/.venv-trl (created on first use, as vs_trl.py does).

Parts and lengths run in a different order each round (reversed every other round). Prints one
line per child, then one JSON object on the last line: medians, min and max over rounds, the
1-minute load average at each child's start.
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
    from gapless.trainer.trainer import GRPOTrainer

    model, lora = build(args.shape)
    big = args.shape != "tiny"
    length, rows = args.length, max(1, args.tokens // args.length)
    cfg = TrainerConfig(max_tokens_per_micro_batch=args.micro_batch_tokens, gradient_checkpointing=big)
    trainer = GRPOTrainer(model, cfg, 1.0, length, lora=lora)
    vocab = model.config.vocab_size
    trainer.step(random_batch(1, 256, vocab) if big else random_batch(rows, length, vocab))  # warm-up
    peak_flops, peak_cpu_flops = matmul_peak()
    batch = random_batch(rows, length, vocab)
    rss_before = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.step(batch)
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    peak = status_kb("VmHWM")
    flops = step_flops(model, rows, length, checkpointing=big, lora=lora is not None)
    return {
        "shape": args.shape,
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
        "cpu_s": cpu_s,
        "matmul_peak_cpu_flop_s": peak_cpu_flops,
        "mfu_cpu": flops / cpu_s / peak_cpu_flops,
    }


def random_batch(rows: int, length: int, vocab: int):
    import torch

    from gapless.trainer.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=g)  # (B, L)
    loss_mask = torch.zeros(rows, length - 1)  # (B, L - 1): the completion's positions
    loss_mask[:, min(PROMPT, length // 2) - 1 :] = 1
    return Batch(
        ids,
        torch.ones_like(ids),
        loss_mask,
        torch.zeros(rows, length - 1),
        torch.randn(rows, generator=g),
        torch.arange(rows) // 2,
    )


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


def step_flops(model, rows: int, length: int, checkpointing: bool, lora: bool) -> float:
    """The FLOPs one step executes (the module docstring's count)."""
    import torch

    c = model.config
    # every Linear of the model, the LM head included (tied or not, it is a Linear); LoRA's own are negligible
    matmul = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in name
    )
    forward = 1 + checkpointing  # forward passes
    per_param = 2 * forward + 2 + (0 if lora else 2)
    hidden = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    attention = (
        2 * (forward + 2) * c.num_hidden_layers * hidden * rows * length**2
    )  # forward: 2 x L^2 x hidden, causal half
    return per_param * matmul * rows * length + attention


def matmul_peak() -> tuple[float, float]:
    """FLOP/s of the best of three fp32 2048^3 matmuls, per wall second and per CPU second."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):
        started, cpu_started = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        best, best_cpu = min(best, time.perf_counter() - started), min(best_cpu, time.process_time() - cpu_started)
    return 2 * 2048**3 / best, 2 * 2048**3 / best_cpu


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,4096,16384,32768")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--big-lengths", default="1024,4096", help="the Qwen2.5-0.5B shape's lengths ('' leaves it out)")
    p.add_argument("--big-tokens", type=int, default=4096)
    p.add_argument("--trl-warmup", type=int, default=2)
    p.add_argument("--trl-steps", type=int, default=3, help="measured steps per side and round (0 leaves TRL out)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", default="tiny", choices=["tiny", "qwen2.5-0.5b"], help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)  # a child's one length
    args = p.parse_args()
    if args.length:
        print(json.dumps(child(args)))
        return
    jobs = [("tiny", int(n), args.tokens) for n in args.lengths.split(",") if n]
    jobs += [("qwen2.5-0.5b", int(n), args.big_tokens) for n in args.big_lengths.split(",") if n]
    trl = None
    if args.trl_steps:
        trl = TrlSides(args)
        jobs += [("trl", 0, 0)]
    runs: dict[tuple, list[dict]] = {}
    try:
        for r in range(args.rounds):
            for shape, length, tokens in jobs if r % 2 == 0 else jobs[::-1]:
                load = os.getloadavg()[0]
                if shape == "trl":
                    for side, rec in trl.round(r):
                        runs.setdefault(("trl", side), []).append({**rec, "load_1m": load})
                    continue
                rec = run_child(args, shape, length, tokens)
                if rec is None:
                    print(f"round {r} {shape} length {length}: failed", flush=True)
                    continue
                runs.setdefault((shape, length), []).append({**rec, "load_1m": load})
                print(
                    f"round {r} {shape:>12} length {length:>6} rows {rec['rows']:>3}  step {rec['step_s']:8.2f} s  "
                    f"step RSS +{rec['step_rss_mb']:7.0f} MB (peak {rec['peak_rss_mb']:.0f})  "
                    f"{rec['flop_s'] / 1e9:6.1f} GFLOP/s = {rec['mfu']:.2f} of matmul peak "
                    f"{rec['matmul_peak_flop_s'] / 1e9:.1f}; per CPU s {rec['mfu_cpu']:.2f} (cpu {rec['cpu_s']:.1f} s)  "
                    f"load {load:.1f}",
                    flush=True,
                )
    finally:
        if trl is not None:
            trl.close()
    print(json.dumps(summarise(args, runs)))


def run_child(args: argparse.Namespace, shape: str, length: int, tokens: int) -> dict | None:
    cmd = [sys.executable, __file__, "--length", str(length), "--tokens", str(tokens), "--shape", shape]
    cmd += ["--micro-batch-tokens", str(args.micro_batch_tokens), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(out.stderr[-2000:], flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


class TrlSides:
    """bench/vs_trl.py's two sides on one saved random-init tiny model, one child each per round."""

    def __init__(self, args: argparse.Namespace) -> None:
        import tempfile
        from pathlib import Path

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import vs_trl

        self.vs_trl, self.args = (
            vs_trl,
            argparse.Namespace(warmup=args.trl_warmup, steps=args.trl_steps, threads=args.threads),
        )
        self.python = vs_trl.ensure_trl_env()
        self.tmp = tempfile.TemporaryDirectory()
        self.model_dir = Path(self.tmp.name) / "model"
        vs_trl.save_model(self.model_dir, 0)

    def round(self, r: int):
        for side in self.vs_trl.SIDES if r % 2 == 0 else self.vs_trl.SIDES[::-1]:
            rec = self.vs_trl.run_side(self.python, side, self.model_dir, self.args)
            step_s = statistics.median(rec["step_s"])
            print(
                f"round {r} {'trl/' + side:>12} sync {step_s:.3f} s/step (steps {', '.join(f'{x:.2f}' for x in rec['step_s'])}), "
                f"cpu {statistics.median(rec['cpu_s']):.3f} s/step, peak {rec['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            cpu_s = statistics.median(rec["cpu_s"])
            yield side, {"step_s": step_s, "cpu_s": cpu_s, "peak_rss_mb": rec["peak_rss_mb"], "steps": rec["step_s"]}

    def close(self) -> None:
        self.tmp.cleanup()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(args: argparse.Namespace, runs: dict[tuple, list[dict]]) -> dict:
    by_length: dict[str, dict] = {}
    for (shape, length), recs in runs.items():
        if shape != "trl":
            keys = ("step_s", "cpu_s", "step_rss_mb", "peak_rss_mb", "mfu", "mfu_cpu", "flop_s", "matmul_peak_flop_s")
            keys += ("load_1m",)
            by_length.setdefault(shape, {})[length] = {k: spread([x[k] for x in recs]) for k in keys}
    out = {"tokens": args.tokens, "big_tokens": args.big_tokens, "micro_batch_tokens": args.micro_batch_tokens}
    out |= {"threads": args.threads, "rounds": args.rounds, "by_shape": by_length}
    g, t = runs.get(("trl", "gapless"), []), runs.get(("trl", "trl"), [])
    if g and t:
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(g, t)]
        out["vs_trl"] = {
            "gapless_step_s": spread([x["step_s"] for x in g]),
            "trl_step_s": spread([x["step_s"] for x in t]),
            "ratio_step_s": statistics.median(x["step_s"] for x in g) / statistics.median(x["step_s"] for x in t),
            "ratio_per_round": ratios,
            "ratio_cpu_s": statistics.median(x["cpu_s"] for x in g) / statistics.median(x["cpu_s"] for x in t),
            "ratio_cpu_s_per_round": [a["cpu_s"] / b["cpu_s"] for a, b in zip(g, t)],
            "target": 0.5,
        }
    return out


if __name__ == "__main__":
    main()
