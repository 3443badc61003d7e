"""How much the sandbox slows the generator's decode on this machine: the question behind the
simulator's pool model (docs/simulator.md, "Where the remaining idle misses come from").

One process decodes with the default job's model shape (random weights, 128 rows, the engine's
native kernels) on 1 or 2 threads and times every decode step; beside it, another process scores
the default code task's groups through the real environment (the sandbox at its configured
concurrency, `pipeline.env_workers` groups at once, each group 8 programs of which 5 distinct),
as the environment actor does during a pipeline run. Phases are interleaved (alone, beside the
sandbox, alone, ...) so that drift on the host hits both. Printed per thread count: the median
decode step alone and beside the sandbox, their ratio, and the groups the sandbox scored per
second meanwhile and alone; the simulator's pool model's prediction for comparison (its
`SharedPool` with the built-in costs' rules: a team at one thread's share, a one-thread decode
served first). JSON on the last line.

    PYTHONPATH=src python bench/contention.py [--rounds 3] [--phase-s 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

GROUP = 8


def score_forever(stop, scored, ready) -> None:
    """The environment actor's load: env_workers threads, each scoring one group after another."""
    from gapless.config import load_config
    from gapless.envs.registry import make_environment
    from gapless.types import Completion

    cfg = load_config(None, {})
    env = make_environment(cfg)
    tasks = list(env.tasks("train"))

    def completions(task, k: int) -> list[Completion]:
        body = task.solution if hasattr(task, "solution") else "pass"
        texts = [body + f"\n# variant {i % 5}" for i in range(k, k + GROUP)]  # 5 distinct programs of 8
        return [Completion([], [], [], [], "stop", t) for t in texts]

    env.score_groups([tasks[0]], [completions(tasks[0], 0)])  # start the sandbox's slots
    ready.set()

    def worker(w: int) -> None:
        k = w
        while not stop.is_set():
            task = tasks[k % len(tasks)]
            env.score_groups([task], [completions(task, k)])
            with scored.get_lock():
                scored.value += 1
            k += cfg.pipeline.env_workers

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(cfg.pipeline.env_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    env.close()


def decode_steps(engine, prompts, params, seconds: float) -> list[float]:
    """Time decode steps at a full batch for `seconds` (refilling as groups finish)."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        while engine.num_running + engine.num_waiting < 128:
            engine.add_request(prompts[len(times) % len(prompts)], params, n=GROUP)
        t = time.perf_counter()
        engine.step()
        if engine.num_running == 128:
            times.append(time.perf_counter() - t)
    return times


def pool_slowdown(threads: int, slots: int, cores: int) -> float:
    """The simulator's prediction: the decode's speed alone over its speed beside the sandbox's
    slots, from simulate/pool.py's SharedPool with the built-in costs' rules (a team of more than
    one thread at one thread's share; a one-thread decode served first)."""
    from gapless.simulate import MACHINE_COSTS as costs
    from gapless.simulate.pool import SharedPool

    def speed(beside: bool) -> float:
        pool = SharedPool.for_costs(cores, costs)
        pool.start("decode", threads, lambda _: None, team=True, first=True)
        if beside:
            pool.start("programs", slots, lambda _: None)
        return pool.speeds["decode"]

    return speed(False) / speed(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=4.0)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()

    import torch

    from gapless.config import load_config
    from gapless.envs.problems import generate_problems
    from gapless.generate.engine import TorchEngine
    from gapless.models import build_tiny
    from gapless.types import SamplingParams

    cfg = load_config(None, {})
    problems = generate_problems(0, "train", 200, [1, 2, 3])
    tiny = build_tiny(cfg.model, [p.prompt + p.solution for p in problems], seed=0)
    prompts = [tiny.encode(p.prompt) for p in problems[:64]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    engine = TorchEngine(tiny.model, tiny.eos_id, max_batch=128, max_seq_len=max(map(len, prompts)) + 32)

    ctx = mp.get_context("spawn")
    results: dict[int, dict[str, list[float]]] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        decode_steps(engine, prompts, params, 1.0)  # warm-up
        res = {"alone_ms": [], "beside_ms": [], "groups_per_s": [], "alone_groups_per_s": []}
        for _ in range(args.rounds):
            res["alone_ms"].append(1e3 * statistics.median(decode_steps(engine, prompts, params, args.phase_s)))
            stop, scored, ready = ctx.Event(), ctx.Value("i", 0), ctx.Event()
            proc = ctx.Process(target=score_forever, args=(stop, scored, ready), daemon=True)
            proc.start()
            ready.wait(120)
            time.sleep(0.5)
            n0, t0 = scored.value, time.perf_counter()
            res["beside_ms"].append(1e3 * statistics.median(decode_steps(engine, prompts, params, args.phase_s)))
            res["groups_per_s"].append((scored.value - n0) / (time.perf_counter() - t0))
            n0, t0 = scored.value, time.perf_counter()
            time.sleep(args.phase_s)  # the sandbox alone
            res["alone_groups_per_s"].append((scored.value - n0) / (time.perf_counter() - t0))
            stop.set()
            proc.join(30)
        results[threads] = res
        slots = cfg.sandbox.concurrency
        alone, beside = statistics.median(res["alone_ms"]), statistics.median(res["beside_ms"])
        print(f"{threads} thread(s): decode step alone {alone:.2f} ms, beside the sandbox {beside:.2f} ms "
              f"({beside / alone:.2f}x; rounds {[round(b / a, 2) for a, b in zip(res['alone_ms'], res['beside_ms'])]}); "
              f"sandbox {statistics.median(res['groups_per_s']):.1f} groups/s meanwhile "
              f"({statistics.median(res['alone_groups_per_s']):.1f} alone); the pool model predicts "
              f"{pool_slowdown(threads, slots, os.cpu_count() or 2):.2f}x", flush=True)
    print(json.dumps({"cores": os.cpu_count(), "rounds": args.rounds, "phase_s": args.phase_s, "results": results}))


if __name__ == "__main__":
    main()
