"""Why the torch engine's speed swings on a shared machine: its decode steps under added CPU
contention, at each thread setting.

The torch engine (default shape: the embedded model, 64 sequences of 32 random prompt tokens,
128 forced new tokens, greedy, fp32) runs in a child process per configuration, while the parent
keeps K busy-looping competitor processes alive (K = 0, 1, ... `--competitors`), so contention is
a controlled variable instead of whatever the machine's other users do. Configurations:
  t2          2 threads (torch's and the native kernels'), OpenMP defaults (GNU: spin, then sleep)
  t1          1 thread
  t2-passive  2 threads, OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once: what a
              torch-engine generator replica and `gapless serve` start with, cluster/placement.py)
Per child: decode tokens/s, and each decode step's wall time (median, p90, max) in ms. Rounds
interleave every (K, configuration); medians per cell and each round's figures are printed, the
last line one JSON object.

    PYTHONPATH=src python bench/engine_threads.py [--rounds 3] [--competitors 0,1] [--configs t2,t1,t2-passive]
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

CONFIGS = {
    "t2": ({}, 2),
    "t1": ({}, 1),
    "t2-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2),
}
SEQUENCES, PROMPT, NEW = 64, 32, 128


def child(config: str) -> dict:
    import random

    import engines  # noqa: F401 -- registers the default shape in real_shapes.SHAPES
    import real_shapes
    import torch

    from gapless.generate.engine import TorchEngine
    from gapless.types import SamplingParams

    _, threads = CONFIGS[config]
    torch.set_num_threads(threads)
    model = real_shapes.build_model("default")
    rng = random.Random(1)
    rows = [[rng.randrange(1, 384) for _ in range(PROMPT)] for _ in range(SEQUENCES)]
    engine = TorchEngine(model, eos_id=0, max_batch=SEQUENCES, max_seq_len=PROMPT + NEW)
    engine.generate(rows[:4], SamplingParams(greedy=True, max_new_tokens=8, ignore_eos=True))  # warm
    params = SamplingParams(greedy=True, max_new_tokens=NEW, ignore_eos=True)
    for row in rows:
        engine.add_request(row, params)
    steps, tokens = [], 0
    start = time.perf_counter()
    while engine.has_work:
        t = time.perf_counter()
        tokens += engine.num_running
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    wall = time.perf_counter() - start
    steps.sort()
    return {
        "config": config,
        "tokens_per_s": tokens / wall,
        "step_ms_p50": steps[len(steps) // 2],
        "step_ms_p90": steps[int(len(steps) * 0.9)],
        "step_ms_max": steps[-1],
        "threads": threads,
        "load_1m": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--competitors", default="0,1")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    cells = [(int(k), c) for k in args.competitors.split(",") for c in args.configs.split(",")]
    rows: list[dict] = []
    for r in range(args.rounds):
        for k, config in cells:
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
            try:
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                env.update(CONFIGS[config][0])
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", config], capture_output=True, text=True, env=env
                )
            finally:
                for s in spinners:
                    s.kill()
                    s.wait()
            try:
                row = {"round": r, "competitors": k, **json.loads(proc.stdout.strip().splitlines()[-1])}
            except (IndexError, ValueError):
                row = {"round": r, "competitors": k, "config": config, "error": proc.stderr.strip().splitlines()[-3:]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    median = {}
    for k, config in cells:
        got = [row for row in rows if row["competitors"] == k and row["config"] == config and "error" not in row]
        if got:
            median[f"{k}/{config}"] = {
                key: round(statistics.median(row[key] for row in got), 2)
                for key in ("tokens_per_s", "step_ms_p50", "step_ms_p90", "step_ms_max")
            } | {
                "tokens_per_s_range": [
                    round(min(r["tokens_per_s"] for r in got)),
                    round(max(r["tokens_per_s"] for r in got)),
                ]
            }
    print(json.dumps({"rounds": rows, "median": median}))


if __name__ == "__main__":
    main()
