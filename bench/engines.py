"""The generator engines side by side on this machine: the torch engine, vLLM (its CPU build here)
and HF `generate`, at the embedded default shape and the Qwen2.5-0.5B shape, fp32.

Workload per phase: S sequences of P random prompt tokens, G new tokens each (forced: EOS
ignored), greedy. Each (shape, engine) runs in its own child process; rounds interleave the
phases (round r runs every phase once before round r + 1 starts), because this machine is shared
and its speed drifts within minutes. Reported per phase: decode tokens/s (generated tokens over
generation wall time, prefill included, start-up excluded), start-up seconds, and for the two
engines that take pushes the seconds to push the full state dict, per GB of fp32 weights
(torch: `TorchEngine.update_weights`; vLLM: the in-place reload, `VLLMEngine.update_weights`).
Every round's figures and the medians are printed; the last line is one JSON object. Each child
also records the machine's 1-minute load average at its start.

Needs vLLM: run from the vLLM venv (bash scripts/setup.sh --vllm):
    .venv-vllm/bin/python bench/engines.py [--rounds 3] [--shapes default,qwen2.5-0.5b] [--threads 2]
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
from real_shapes import SHAPES

SHAPES = dict(SHAPES)
SHAPES["default"] = dict(
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
WORKLOAD = {"default": (64, 32, 128), "qwen2.5-0.5b": (16, 32, 64)}  # sequences, prompt tokens, new tokens
PHASES = ("torch", "vllm", "hf")


def child(args) -> dict:
    import torch
    from real_shapes import build_model

    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    sequences, prompt_tokens, new_tokens = WORKLOAD[args.shape]
    import random

    rng = random.Random(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(sequences)]
    started = time.perf_counter()
    model = build_model(args.shape) if args.shape != "default" else _default_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
    out = {"phase": args.phase, "shape": args.shape, "load_1m": load, "weights_gb": gb}
    from gapless.types import SamplingParams

    params = SamplingParams(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    if args.phase == "hf":
        with torch.no_grad():
            out["startup_s"] = time.perf_counter() - started
            t = time.perf_counter()
            ids = torch.tensor(rows)
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            out["tokens_per_s"] = sequences * new_tokens / (time.perf_counter() - t)
        return out
    if args.phase == "torch":
        from gapless.generate.engine import TorchEngine

        engine = TorchEngine(model, eos_id=0, max_batch=sequences, max_seq_len=prompt_tokens + new_tokens)
    else:
        import tempfile

        from gapless.generate.vllm.engine import VLLMEngine

        path = Path(tempfile.mkdtemp()) / "model"
        model.save_pretrained(path)
        engine = VLLMEngine(
            str(path),
            eos_id=0,
            max_batch=sequences,
            max_seq_len=prompt_tokens + new_tokens,
            dtype="float32",
            prefix_caching=False,
        )
    out["startup_s"] = time.perf_counter() - started
    engine.generate(rows[:2], SamplingParams(greedy=True, max_new_tokens=4, ignore_eos=True))  # warm
    t = time.perf_counter()
    got = engine.generate(rows, params)
    out["tokens_per_s"] = sum(len(c.token_ids) for c in got) / (time.perf_counter() - t)
    t = time.perf_counter()
    engine.update_weights(state, version=1)
    out["push_s_per_gb"] = (time.perf_counter() - t) / gb
    return out


def _default_model():
    from real_shapes import build_model

    return build_model("default")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="default,qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--phase")
    ap.add_argument("--shape")
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(child(args)))
        return
    rounds: list[list[dict]] = []
    for r in range(args.rounds):
        results = []
        for shape in args.shapes.split(","):
            for phase in PHASES:
                cmd = [sys.executable, __file__, "--phase", phase, "--shape", shape, "--threads", str(args.threads)]
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
                )
                try:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                except (IndexError, ValueError):
                    row = {"phase": phase, "shape": shape, "error": proc.stderr.strip().splitlines()[-1:]}
                print(f"round {r}: {json.dumps(row)}", flush=True)
                results.append(row)
        rounds.append(results)
    summary = {}
    for shape in args.shapes.split(","):
        for phase in PHASES:
            rows = [
                row
                for rnd in rounds
                for row in rnd
                if row["shape"] == shape and row["phase"] == phase and "error" not in row
            ]
            if rows:
                summary[f"{shape}/{phase}"] = {
                    k: statistics.median(row[k] for row in rows) for k in rows[0] if isinstance(rows[0][k], float)
                }
    print(json.dumps({"threads": args.threads, "rounds": rounds, "median": summary}))


if __name__ == "__main__":
    main()
