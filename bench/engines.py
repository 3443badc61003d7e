"""The generator engines side by side on this machine: the torch engine, vLLM (its CPU build here)
and HF `generate`, at the embedded default shape and the Qwen2.5-0.5B and Qwen3-0.6B shapes
(random weights, real_shapes.py), fp32, and bf16 too with `--dtypes float32,bfloat16`.

Workload per phase: S sequences of P random prompt tokens, G new tokens each (forced: EOS
ignored), greedy (WORKLOAD). Each (shape, engine) runs in its own child process; rounds interleave the
phases (round r runs every phase once before round r + 1 starts), because this machine is shared
and its speed drifts within minutes. Reported per phase: decode tokens/s (generated tokens over
generation wall time, prefill included, start-up excluded), start-up seconds, and for the two
engines that take pushes the seconds to push the full state dict, per GB of fp32 weights
(torch: `TorchEngine.update_weights`; vLLM: the in-place reload, `VLLMEngine.update_weights`).
Both engines' children start with OMP_WAIT_POLICY=PASSIVE, as a generator replica does (`--spin`:
OpenMP's default; HF `generate` gets the caller's environment either way).
Every round's figures and the medians are printed; the last line is one JSON object. Each child
also records the machine's 1-minute load average at its start and end, and the CPU seconds other
processes used while it generated (`outside_cores`: this machine is shared).

Needs vLLM: run from the vLLM venv (bash scripts/setup.sh --vllm):
    .venv-vllm/bin/python bench/engines.py [--rounds 3] [--shapes default,qwen2.5-0.5b,qwen3-0.6b]
        [--dtypes float32[,bfloat16]] [--threads 2] [--phases torch,vllm,hf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import real_shapes

from gapless.cluster.placement import ENGINE_WAIT_POLICY

real_shapes.SHAPES["default"] = dict(  # the embedded default model (config ModelConfig)
    model_type="qwen2",
    vocab_size=384,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# sequences, prompt tokens, new tokens
WORKLOAD = {"default": (64, 32, 128), "qwen2.5-0.5b": (16, 32, 32), "qwen3-0.6b": (16, 32, 32)}
PHASES = ("torch", "vllm", "hf")


def _cpu_s() -> float:
    """CPU seconds of every process on the machine (/proc/stat: user + nice + system)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4]
    return sum(int(f) for f in fields) / os.sysconf("SC_CLK_TCK")


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    sequences, prompt_tokens, new_tokens = WORKLOAD[args.shape]
    import random

    rng = random.Random(1)
    vocab = real_shapes.SHAPES[args.shape]["vocab_size"]
    rows = [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(sequences)]
    started = time.perf_counter()
    model = real_shapes.build_model(args.shape, args.dtype)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    out = {"phase": args.phase, "shape": args.shape, "dtype": args.dtype, "load_1m": load, "weights_gb": gb}
    from gapless.types import SamplingParams

    params = SamplingParams(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    if args.phase == "hf":
        with torch.no_grad():
            out["startup_s"] = time.perf_counter() - started
            t, cpu = time.perf_counter(), _cpu_s() - _own_cpu_s()
            ids = torch.tensor(rows)
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            wall = time.perf_counter() - t
            out["tokens_per_s"] = sequences * new_tokens / wall
            out["outside_cores"] = (_cpu_s() - _own_cpu_s() - cpu) / wall
        out["load_1m_end"] = os.getloadavg()[0]
        return out
    if args.phase == "torch":
        from gapless.generate.engine import TorchEngine

        engine = TorchEngine(model, eos_id=0, max_batch=sequences, max_seq_len=prompt_tokens + new_tokens)
        out["native"] = getattr(engine.runner, "native", None) is not None
    else:
        import atexit
        import shutil
        import tempfile

        from gapless.generate.vllm.engine import VLLMEngine

        tmp = tempfile.mkdtemp()
        atexit.register(shutil.rmtree, tmp, True)  # a real shape's checkpoint is GBs
        path = Path(tmp) / "model"
        model.save_pretrained(path)
        engine = VLLMEngine(
            str(path),
            eos_id=0,
            max_batch=sequences,
            max_seq_len=prompt_tokens + new_tokens,
            dtype=args.dtype,
            prefix_caching=False,
        )
    out["startup_s"] = time.perf_counter() - started
    engine.generate(rows[:2], SamplingParams(greedy=True, max_new_tokens=4, ignore_eos=True))  # warm
    t, cpu = time.perf_counter(), _cpu_s() - _own_cpu_s()
    got = engine.generate(rows, params)
    wall = time.perf_counter() - t
    out["tokens_per_s"] = sum(len(c.token_ids) for c in got) / wall
    out["outside_cores"] = (_cpu_s() - _own_cpu_s() - cpu) / wall
    t = time.perf_counter()
    engine.update_weights(state, version=1)
    out["push_s_per_gb"] = (time.perf_counter() - t) / gb
    out["load_1m_end"] = os.getloadavg()[0]
    return out


def _own_cpu_s() -> float:
    usage = os.times()
    return usage.user + usage.system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="default,qwen2.5-0.5b,qwen3-0.6b")
    ap.add_argument("--dtypes", default="float32", help="float32 and/or bfloat16 (bf16: a CPU with avx512_bf16)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin", action="store_true", help="the engines under OpenMP's default wait policy (spinning)")
    ap.add_argument("--phase")
    ap.add_argument("--shape")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(child(args)))
        return
    cases = [
        (shape, dtype, phase)
        for shape in args.shapes.split(",")
        for dtype in args.dtypes.split(",")
        for phase in args.phases.split(",")
    ]
    rounds: list[list[dict]] = []
    for r in range(args.rounds):
        results = []
        for shape, dtype, phase in cases:
            cmd = [sys.executable, __file__, "--phase", phase, "--shape", shape, "--dtype", dtype]
            env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
            if (
                phase in ("torch", "vllm") and not args.spin
            ):  # as a generator replica runs it (placement.engine_environ)
                env.update(ENGINE_WAIT_POLICY)
            proc = subprocess.run([*cmd, "--threads", str(args.threads)], capture_output=True, text=True, env=env)
            try:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                row = {"phase": phase, "shape": shape, "dtype": dtype, "error": proc.stderr.strip().splitlines()[-3:]}
            print(f"round {r}: {json.dumps(row)}", flush=True)
            results.append(row)
        rounds.append(results)
    summary = {}
    for shape, dtype, phase in cases:
        rows = [
            row
            for rnd in rounds
            for row in rnd
            if (row["shape"], row["dtype"], row["phase"]) == (shape, dtype, phase) and "error" not in row
        ]
        if rows:
            summary[f"{shape}/{dtype}/{phase}"] = {
                k: statistics.median(row[k] for row in rows) for k in rows[0] if isinstance(rows[0][k], float)
            }
    print(json.dumps({"threads": args.threads, "rounds": rounds, "median": summary}))


if __name__ == "__main__":
    main()
