"""Tinker-service sampling benchmark: the service's tokens/s against the engine's own, same requests.

`gapless serve-training` runs in a subprocess over a locally built model (bench/generate.py's
TINY shape, context 512) named as a base model in a service config; the official `tinker` SDK
drives it from this process. Workloads, interleaved round by round (A B A B ...):
  service  `--prompts` sample calls of `--samples` sequences each (one sampling client on the
           base model), all in flight at once, then every result awaited
  engine   the same prompts and sampling parameters straight into a TorchEngine in this process
           (same model, same max_batch, same torch thread count), stepped until done
Every sequence is forced to `--tokens` new tokens (`stop=[]` disables EOS, as the SDK documents;
`ignore_eos` on the engine), sampled at T = 1. tokens/s is completion tokens over the workload's
wall time; the ratio is service over engine, per round, then the median. Also reported: the CPU
other processes used during each run (a busy machine lowers both sides, not just one).

    PYTHONPATH=src python bench/service.py [--rounds 3] [--prompts 16] [--samples 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import tinker
import torch
from generate import TINY, LoadMeter
from tinker import types

from gapless.generate.engine import TorchEngine
from gapless.models import build_tiny, load_local
from gapless.types import SamplingParams

SRC = Path(__file__).resolve().parents[1] / "src"
KEY = "tml-bench"
PROMPTS = [f"Question {i}: name {i % 7} fruits, colours or animals, then explain why." for i in range(64)]


def start_service(config: Path, threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gapless.cli", "serve-training", str(config), "--port", "0", "--threads", str(threads)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "TINKER_API_KEY": KEY},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if " at http://" not in line:
        proc.kill()
        raise RuntimeError(f"the service did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split(" at ", 1)[1].split()[0]


def via_service(sampler, prompts: list[list[int]], samples: int, tokens: int) -> int:
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(p),
            num_samples=samples,
            sampling_params=types.SamplingParams(**{**params.model_dump(), "seed": i}),
        )
        for i, p in enumerate(prompts)
    ]
    return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def via_engine(engine: TorchEngine, prompts: list[list[int]], samples: int, tokens: int) -> int:
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True), samples)
    done = []
    while engine.has_work:
        done += engine.step()
    return sum(len(c.token_ids) for c in done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="num_samples per sample call")
    parser.add_argument("--tokens", type=int, default=64, help="forced new tokens per sequence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, service and engine alike")
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "base"
        build_tiny(TINY, PROMPTS, seed=0, max_positions=512).save(model_dir)
        config = Path(tmp) / "service.toml"
        config.write_text(
            f"[service]\nbase_models = {{bench = {json.dumps(str(model_dir))}}}\n"
            f"checkpoint_dir = {json.dumps(str(Path(tmp) / 'ckpt'))}\nmax_batch = {args.max_batch}\n"
            "max_seq_len = 512\n"
        )
        policy = load_local(model_dir)
        prompts = [policy.encode(p) for p in PROMPTS[: args.prompts]]
        engine = TorchEngine(policy.model, policy.eos_id, max_batch=args.max_batch, max_seq_len=512)
        proc, url = start_service(config, args.threads)
        try:
            client = tinker.ServiceClient(base_url=url, api_key=KEY)
            sampler = client.create_sampling_client(base_model="bench").result()
            via_service(sampler, prompts[:2], 1, 4)  # warm: engine built, kernels compiled
            via_engine(engine, prompts[:2], 1, 4)
            runs = {"service": [], "engine": []}
            for _ in range(args.rounds):
                for name, fn in (
                    ("service", lambda: via_service(sampler, prompts, args.samples, args.tokens)),
                    ("engine", lambda: via_engine(engine, prompts, args.samples, args.tokens)),
                ):
                    with LoadMeter() as meter:
                        count = fn()
                    runs[name].append(
                        {
                            "tokens": count,
                            "wall_s": meter.wall_s,
                            "tokens_per_s": count / meter.wall_s,
                            "outside_cores": meter.outside_cores,
                        }
                    )
            client.close("success").result()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ratios = [s["tokens_per_s"] / e["tokens_per_s"] for s, e in zip(runs["service"], runs["engine"])]
    result = {
        "rounds": args.rounds,
        "prompts": args.prompts,
        "samples": args.samples,
        "tokens": args.tokens,
        "threads": args.threads,
        "ratio_service_vs_engine": statistics.median(ratios),
        "ratios": ratios,
        "tokens_per_s_median": {k: statistics.median(r["tokens_per_s"] for r in rs) for k, rs in runs.items()},
        "outside_cores_max": max(r["outside_cores"] for rs in runs.values() for r in rs),
        "runs": runs,
    }
    for name, rs in runs.items():
        print(f"{name:<8} {result['tokens_per_s_median'][name]:8.0f} tokens/s")
    print(
        f"service / engine: {result['ratio_service_vs_engine']:.2f}x (rounds: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"); other processes <= {result['outside_cores_max']:.2f} cores"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
