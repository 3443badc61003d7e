"""Real model shapes on this machine: the torch engine against HF `generate` and transformers'
own continuous batching (`generate_batch`), the share of the measured matmul peak, and one RL step.

Models: randomly initialised checkpoints with the exact shapes of Qwen2.5-0.5B and Qwen3-0.6B
(layers, widths, heads, KV heads, head dims, MLP widths, RoPE theta, tied embeddings and their
true 151,936-token vocabularies), built from transformers configs with one seed, so every phase
runs the same weights. Nothing is downloaded.
Workload (each generator): S sequences (default 16) of P random prompt tokens (default 32), G new
tokens each (default 64, forced: EOS ignored), greedy, fp32.
  engine         `TorchEngine` (max_batch = S), native kernels where they build
  hf_generate    `model.generate` on the S rows in one batch (no padding: equal prompt lengths)
  generate_batch `model.generate_batch` (transformers' paged continuous batching), same rows
  rl_step        (--rl-step) one full GRPO optimizer step of gapless's trainer on S completions
                 of P + G tokens: seconds and peak resident memory. fp32 AdamW holds weights,
                 gradients and two moments: about 16 bytes per parameter (~10 GB for the Qwen3
                 shape), so it is off by default on a shared machine. The whole RL step (sample,
                 score, train, push; full and LoRA) against TRL's `GRPOTrainer` on equal work is
                 bench/rl_step_vs_trl.py
  vllm           (--device cuda) gapless's `VLLMEngine` on the same rows, bf16
Each phase runs in its own child process, so its peak resident memory (VmHWM) is its own and at
most one copy of a model is alive. FLOP/s count 2N per prefilled or generated token (N =
parameters, the tied head once, attention excluded), against the best fp32 matmul GFLOP/s
measured in the same child (bench/generate.py's `matmul_peak_gflops`). At decode's few rows a
step is bound by memory, not by the matmul peak: each phase also measures the memory read
bandwidth (`memory_read_gbps`) and reports its roofline (every decode step streams the fp32
weights once, the prefill runs at the matmul peak) as `roofline_tokens_per_s` and the phase's
share of it; `roofline_vs_hf_generate` is the most any fp32 engine could be ahead of HF on this
host. Every timed block also
records the cores other processes used meanwhile (`outside_cores`): this machine is shared.
Prints one line per phase, then one JSON object on the last line.

    PYTHONPATH=src python bench/real_shapes.py [--shapes qwen2.5-0.5b,qwen3-0.6b] [--threads 2] [--rounds 1]
        [--sequences 16] [--prompt-tokens 32] [--new-tokens 64] [--rl-step] [--device cpu|cuda]
--rounds R runs every phase R times, round by round (the machine's speed drifts by tens of
percent within minutes), and reports medians and each round's engine ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # a seconds-long stand-in for checking the script itself (--shapes tiny)
    "tiny": dict(
        model_type="qwen3",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
CPU_PHASES = ["engine", "hf_generate", "generate_batch"]


def build_model(shape: str, dtype="float32", device="cpu"):
    import torch
    import transformers

    spec = dict(SHAPES[shape])
    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[spec.pop("model_type")]
    theta = spec.pop("rope_theta")
    config = config_class(**spec, rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def prompts(args) -> list[list[int]]:
    import random

    rng = random.Random(1)
    return [[rng.randrange(1000, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.sequences)]


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def child(args) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from generate import LoadMeter, matmul_peak_gflops, memory_read_gbps  # bench/generate.py

    torch.set_num_threads(args.threads)
    rows, total = prompts(args), args.sequences * args.new_tokens
    started = time.perf_counter()
    if args.phase == "vllm":
        return vllm_phase(args, rows)
    model = build_model(args.shape)
    params = sum(p.numel() for p in model.parameters())
    out = {"phase": args.phase, "shape": args.shape, "params": params, "build_s": time.perf_counter() - started}
    if args.phase == "rl_step":
        out.update(rl_step(model, rows, args))
        out["peak_rss_gb"] = peak_rss_gb()
        return out
    peak = matmul_peak_gflops(sizes=(1024, 2048), reps=5)
    bandwidth = memory_read_gbps()
    flop_tokens = total + args.sequences * args.prompt_tokens
    # the roofline: every decode step streams the weights once (fp32, the tied head counted once),
    # the prefill is compute at the matmul peak
    roofline_s = (
        args.new_tokens * params * 4 / bandwidth / 1e9
        + 2 * params * args.sequences * args.prompt_tokens / peak["gflops"] / 1e9
    )
    if args.phase == "engine":
        from gapless.generate.engine import TorchEngine
        from gapless.types import SamplingParams

        engine = TorchEngine(
            model, eos_id=0, max_batch=args.sequences, max_seq_len=args.prompt_tokens + args.new_tokens
        )
        del model
        gc.collect()  # the engine holds its own copy
        engine.generate(rows[:2], SamplingParams(greedy=True, max_new_tokens=4, ignore_eos=True))  # packs, compiles
        with LoadMeter() as meter:
            done = engine.generate(rows, SamplingParams(greedy=True, max_new_tokens=args.new_tokens, ignore_eos=True))
        assert sum(len(c.token_ids) for c in done) == total
        out["path"] = engine.path
    else:
        with torch.no_grad():
            if args.phase == "hf_generate":
                ids = torch.tensor(rows)
                model.generate(
                    input_ids=ids[:2],
                    attention_mask=torch.ones_like(ids[:2]),
                    do_sample=False,
                    max_new_tokens=4,
                    min_new_tokens=4,
                    pad_token_id=0,
                )
                with LoadMeter() as meter:
                    result = model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=False,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                        pad_token_id=0,
                    )
                assert result.shape == (args.sequences, args.prompt_tokens + args.new_tokens)
            else:
                from transformers import GenerationConfig
                from transformers.generation.configuration_utils import ContinuousBatchingConfig

                config = GenerationConfig(
                    max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
                )
                pages = ContinuousBatchingConfig(
                    num_blocks=4 * args.sequences, max_batch_tokens=args.sequences * args.prompt_tokens
                )
                model.generate_batch(inputs=rows[:2], generation_config=config, continuous_batching_config=pages)
                with LoadMeter() as meter:
                    result = model.generate_batch(
                        inputs=rows, generation_config=config, continuous_batching_config=pages
                    )
                assert sum(len(o.generated_tokens) for o in result.values()) == total
    tokens_per_s = total / meter.wall_s
    out.update(
        tokens_per_s=tokens_per_s,
        wall_s=meter.wall_s,
        outside_cores=meter.outside_cores,
        peak_gflops=peak["gflops"],
        peak_share=2 * params * flop_tokens / meter.wall_s / 1e9 / peak["gflops"],
        read_gbps=bandwidth,
        roofline_tokens_per_s=total / roofline_s,
        roofline_share=roofline_s / meter.wall_s,
        peak_rss_gb=peak_rss_gb(),
    )
    return out


def rl_step(model, rows, args) -> dict:
    """One optimizer step of gapless's GRPO trainer on S completions of random tokens."""
    import torch

    from gapless.config import TrainerConfig
    from gapless.trainer.batch import build_batch, token_logprobs
    from gapless.trainer.trainer import GRPOTrainer
    from gapless.types import Completion

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
        batch.behaviour_logprobs.copy_(token_logprobs(model, batch.input_ids, batch.attention_mask) * batch.loss_mask)
    trainer = GRPOTrainer(model, TrainerConfig(), 1.0, args.new_tokens)
    started = time.perf_counter()
    trainer.step(batch)
    return {"step_s": time.perf_counter() - started}


def vllm_phase(args, rows) -> dict:
    """The GPU path: gapless's VLLMEngine on the same rows (bf16), from a saved random checkpoint."""
    import tempfile

    import torch

    from gapless.generate.vllm.engine import VLLMEngine
    from gapless.types import SamplingParams

    model = build_model(args.shape, dtype="bfloat16")
    directory = Path(tempfile.mkdtemp(prefix="real-shapes-"))
    model.save_pretrained(directory)
    del model
    engine = VLLMEngine(
        str(directory),
        eos_id=0,
        max_batch=args.sequences,
        max_seq_len=args.prompt_tokens + args.new_tokens,
        dtype="bfloat16",
        gpu_memory_utilization=0.5,
        skip_tokenizer_init=True,
    )
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(rows[:2], SamplingParams(greedy=True, max_new_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    started = time.perf_counter()
    done = engine.generate(rows, params)
    wall = time.perf_counter() - started
    total = sum(len(c.token_ids) for c in done)
    return {"phase": "vllm", "shape": args.shape, "tokens_per_s": total / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen3-0.6b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rl-step", action="store_true", help="also one full RL step (~16 bytes per parameter of memory)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every phase; medians and per-round ratios")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--phases", default=None, help="comma-separated subset of the phases")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(child(args)))
        return
    phases = (
        args.phases.split(",")
        if args.phases
        else (["vllm"] if args.device == "cuda" else CPU_PHASES + (["rl_step"] if args.rl_step else []))
    )
    results: dict[str, dict] = {shape: {} for shape in args.shapes.split(",")}
    for round_ in range(
        args.rounds
    ):  # every phase once per round: each ratio compares runs minutes apart, not a round apart
        for shape in results:
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
                    "--sequences",
                    str(args.sequences),
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                    "--new-tokens",
                    str(args.new_tokens),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = proc.stdout.strip().splitlines()
                if proc.returncode != 0 or not lines:
                    result = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
                else:
                    result = json.loads(lines[-1])
                results[shape].setdefault(phase, []).append(result)
                print(f"round {round_ + 1}", shape, phase, json.dumps(result), flush=True)
    summary = {}
    for shape, by_phase in results.items():
        summary[shape] = {
            phase: {
                key: statistics.median(r[key] for r in runs)
                for key in ("tokens_per_s", "peak_share", "roofline_share", "step_s", "peak_rss_gb")
                if all(key in r for r in runs)
            }
            for phase, runs in by_phase.items()
        }
        rounds = [dict(zip(CPU_PHASES, runs)) for runs in zip(*(by_phase.get(p, []) for p in CPU_PHASES))]
        if rounds and all("tokens_per_s" in r for row in rounds for r in row.values()):
            for other in ("hf_generate", "generate_batch"):
                ratios = [row["engine"]["tokens_per_s"] / row[other]["tokens_per_s"] for row in rounds]
                summary[shape][f"engine_vs_{other}"] = {"per_round": ratios, "median": statistics.median(ratios)}
                # the most any fp32 engine could be ahead of `other` on this host: the memory roofline's speed over its
                ceiling = [row["engine"]["roofline_tokens_per_s"] / row[other]["tokens_per_s"] for row in rounds]
                summary[shape][f"roofline_vs_{other}"] = {"per_round": ceiling, "median": statistics.median(ceiling)}
    print(
        json.dumps(
            {
                "threads": args.threads,
                "sequences": args.sequences,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "rounds": args.rounds,
                "summary": summary,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
