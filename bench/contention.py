"""How much the sandbox slows the generator's decode on this machine: the question behind the
simulator's pool model (docs/lab/2026-12-06-simulator-fits.md, "Where the remaining idle misses come from").

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
    PYTHONPATH=src python bench/contention.py --part matrix [--rounds 3] [--phase-s 3]
    PYTHONPATH=src python bench/contention.py --part train-threads [--rounds 3] [--phase-s 4]

`--part matrix`: the three loads of an asynchronous step on this machine, one thread each where
the pipeline gives them one (budgets >= 1): the decode above, a training step of the same model
(forward and backward over 32 sequences of 64 tokens, AdamW) in another process, and the
sandbox. For every combination of them, each load's speed beside the others as a share of its
speed alone (decode and training: median step time alone / beside; the sandbox: groups scored
per second beside / alone), with the pool model's prediction beside each (its `SharedPool` with
the built-in costs' rules: the decode a one-thread job served first, the training step a
one-thread team, the sandbox `sandbox.concurrency` programs).

`--part train-threads`: the question behind core lending's rule (orchestrate/lending.py): the
same training step (forward and backward, then AdamW) in this process on 1 and on 2 threads,
alone and beside the sandbox, interleaved round by round. Printed per thread count: the median
step alone and beside, their ratio, and beside the sandbox the 2-thread step over the 1-thread
one (above 1: a borrowed thread slows the trainer while the environment scores).
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


def train_forever(stop, go, times) -> None:
    """One training thread: steps of the decode's model on 32 x 64 tokens until `stop`, timed."""
    import torch

    torch.set_num_threads(1)
    model, optimizer, ids = training_setup()
    go.wait()
    while not stop.is_set():
        times.append(train_step(model, optimizer, ids))


def training_setup():
    """The decode's model, AdamW and a batch of 32 x 64 token ids."""
    import torch

    model = build_model()[1].model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer, torch.randint(0, 100, (32, 64), generator=torch.Generator().manual_seed(0))


def train_step(model, optimizer, ids) -> float:
    """One training step (forward, backward, AdamW); its wall seconds."""
    start = time.perf_counter()
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def train_steps(model, optimizer, ids, seconds: float) -> list[float]:
    """Training steps for `seconds`; each one's wall time."""
    out, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        out.append(train_step(model, optimizer, ids))
    return out


def part_train_threads(args) -> dict:
    """A training step on 1 and 2 threads, alone and beside the sandbox, rounds interleaved."""
    import torch

    model, optimizer, ids = training_setup()
    threads = [int(t) for t in args.threads.split(",")]
    ctx = mp.get_context("spawn")
    ms: dict[int, dict[str, list[float]]] = {t: {"alone": [], "beside": []} for t in threads}
    for t in threads:
        torch.set_num_threads(t)
        train_steps(model, optimizer, ids, 1.0)  # warm-up
    for _ in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            ms[t]["alone"].append(1e3 * statistics.median(train_steps(model, optimizer, ids, args.phase_s)))
        stop, _, proc = start_sandbox(ctx)
        for t in threads:
            torch.set_num_threads(t)
            ms[t]["beside"].append(1e3 * statistics.median(train_steps(model, optimizer, ids, args.phase_s)))
        stop.set()
        proc.join(30)
    medians = {t: {k: statistics.median(v) for k, v in m.items()} for t, m in ms.items()}
    for t in threads:
        a, b = medians[t]["alone"], medians[t]["beside"]
        print(
            f"{t} thread(s): training step alone {a:.1f} ms, beside the sandbox {b:.1f} ms ({b / a:.2f}x; "
            f"rounds {[round(y / x, 2) for x, y in zip(ms[t]['alone'], ms[t]['beside'])]})",
            flush=True,
        )
    out = {"ms": ms, "median_ms": medians}
    if 1 in medians and 2 in medians:
        out["beside_2_over_1"] = medians[2]["beside"] / medians[1]["beside"]
        out["alone_2_over_1"] = medians[2]["alone"] / medians[1]["alone"]
        print(
            f"2 threads / 1 thread: {out['alone_2_over_1']:.2f} alone, {out['beside_2_over_1']:.2f} beside the sandbox"
        )
    return out


def build_model():
    from gapless.config import load_config
    from gapless.envs.code.problems import generate_problems
    from gapless.models import build_tiny

    cfg = load_config(None, {})
    problems = generate_problems(0, "train", 200, [1, 2, 3])
    return problems, build_tiny(cfg.model, [p.prompt + p.solution for p in problems], seed=0)


LOADS = ("decode", "train", "sandbox")


def pool_matrix(slots: int, cores: int) -> dict[str, dict[str, float]]:
    """The pool model's speeds (share of alone) for every combination of LOADS."""
    from itertools import combinations

    from gapless.simulate import MACHINE_COSTS as costs
    from gapless.simulate.pool import SharedPool

    def speeds(loads) -> dict[str, float]:
        pool = SharedPool.for_costs(cores, costs)
        for load in loads:
            pool.start(
                load,
                {"decode": 1.0, "train": 1.0, "sandbox": float(slots)}[load],
                lambda _: None,
                team=load != "sandbox",
                first=load == "decode",
            )
        return dict(pool.speeds)

    alone = {load: speeds([load])[load] for load in LOADS}
    return {
        "+".join(c): {load: v / alone[load] for load, v in speeds(c).items()}
        for n in (2, 3)
        for c in combinations(LOADS, n)
    }


def start_sandbox(ctx):
    """The environment's load in another process, scoring once this returns: (stop, the count of
    groups scored, the process)."""
    stop, scored, ready = ctx.Event(), ctx.Value("i", 0), ctx.Event()
    proc = ctx.Process(target=score_forever, args=(stop, scored, ready), daemon=True)
    proc.start()
    ready.wait(120)
    time.sleep(0.5)
    return stop, scored, proc


def scored_per_s(scored, during):
    """Groups scored per second while `during()` runs, and what it returned."""
    n0, t0 = scored.value, time.perf_counter()
    out = during()
    return (scored.value - n0) / (time.perf_counter() - t0), out


def part_matrix(args, engine, prompts, params, slots: int) -> dict:
    """Each combination of decode, training and sandbox, interleaved round by round."""
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    phase = args.phase_s
    rounds = []
    for r in range(args.rounds):
        stop, go, times = ctx.Event(), ctx.Event(), manager.list()
        trainer = ctx.Process(target=train_forever, args=(stop, go, times), daemon=True)
        trainer.start()
        time.sleep(1.0)

        def decode_median():
            return statistics.median(decode_steps(engine, prompts, params, phase))

        res: dict[str, float] = {"decode": decode_median()}
        go.set()
        while not times and trainer.is_alive():  # its first step done: the model is built (slow on a busy machine)
            time.sleep(0.05)
        time.sleep(1.0)

        def train_median(seconds: float | None = None, during=None):
            n = len(times)
            out = during() if during else time.sleep(seconds)
            return statistics.median(list(times)[n:]), out

        res["train|decode"], res["decode|train"] = train_median(during=decode_median)
        res["train"], _ = train_median(phase)
        sandbox_stop, scored, sandbox = start_sandbox(ctx)
        res["sandbox|train"], (res["train|sandbox"], _) = scored_per_s(scored, lambda: train_median(phase))
        res["sandbox|decode+train"], (res["train|decode+sandbox"], res["decode|train+sandbox"]) = scored_per_s(
            scored, lambda: train_median(during=decode_median)
        )
        stop.set()
        trainer.join(30)
        res["sandbox|decode"], res["decode|sandbox"] = scored_per_s(scored, decode_median)
        res["sandbox"], _ = scored_per_s(scored, lambda: time.sleep(phase))
        sandbox_stop.set()
        sandbox.join(30)
        shares = {}
        for key, value in res.items():
            load, _, beside = key.partition("|")
            if beside:
                alone = res[load]
                combo = "+".join(x for x in LOADS if x == load or x in beside.split("+"))
                shares.setdefault(combo, {})[load] = value / alone if load == "sandbox" else alone / value
        rounds.append({"alone": {load: res[load] for load in LOADS}, "shares": shares})
        print(
            f"round {r}: "
            + "; ".join(
                f"{combo}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s.items()))
                for combo, s in sorted(shares.items())
            ),
            flush=True,
        )
    predicted = pool_matrix(slots, os.cpu_count() or 2)
    print("speed beside the others / alone, median of rounds (the pool model's prediction):")
    medians = {}
    for combo in predicted:
        medians[combo] = {
            load: statistics.median(r["shares"][combo][load] for r in rounds) for load in predicted[combo]
        }
        print(
            f"  {combo:<20} "
            + "  ".join(
                f"{load} {medians[combo][load]:.2f} ({predicted[combo][load]:.2f})"
                for load in LOADS
                if load in predicted[combo]
            )
        )
    return {"rounds": rounds, "median": medians, "predicted": predicted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="sandbox", choices=["sandbox", "matrix", "train-threads"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=4.0)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    if args.part == "train-threads":
        out = part_train_threads(args)
        print(
            json.dumps({"cores": os.cpu_count(), "rounds": args.rounds, "phase_s": args.phase_s, "train_threads": out})
        )
        return

    import torch

    from gapless.config import load_config
    from gapless.generate.engine import TorchEngine
    from gapless.types import SamplingParams

    cfg = load_config(None, {})
    problems, tiny = build_model()
    prompts = [tiny.encode(p.prompt) for p in problems[:64]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    engine = TorchEngine(tiny.model, tiny.eos_id, max_batch=128, max_seq_len=max(map(len, prompts)) + 32)

    if args.part == "matrix":
        torch.set_num_threads(1)
        decode_steps(engine, prompts, params, 1.0)  # warm-up
        out = part_matrix(args, engine, prompts, params, cfg.sandbox.concurrency)
        print(json.dumps({"cores": os.cpu_count(), "rounds": args.rounds, "phase_s": args.phase_s, "matrix": out}))
        return
    ctx = mp.get_context("spawn")
    results: dict[int, dict[str, list[float]]] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        decode_steps(engine, prompts, params, 1.0)  # warm-up
        res = {"alone_ms": [], "beside_ms": [], "groups_per_s": [], "alone_groups_per_s": []}
        for _ in range(args.rounds):
            res["alone_ms"].append(1e3 * statistics.median(decode_steps(engine, prompts, params, args.phase_s)))
            stop, scored, proc = start_sandbox(ctx)
            rate, beside = scored_per_s(
                scored, lambda: statistics.median(decode_steps(engine, prompts, params, args.phase_s))
            )
            res["beside_ms"].append(1e3 * beside)
            res["groups_per_s"].append(rate)
            res["alone_groups_per_s"].append(
                scored_per_s(scored, lambda: time.sleep(args.phase_s))[0]
            )  # the sandbox alone
            stop.set()
            proc.join(30)
        results[threads] = res
        slots = cfg.sandbox.concurrency
        alone, beside = statistics.median(res["alone_ms"]), statistics.median(res["beside_ms"])
        print(
            f"{threads} thread(s): decode step alone {alone:.2f} ms, beside the sandbox {beside:.2f} ms "
            f"({beside / alone:.2f}x; rounds {[round(b / a, 2) for a, b in zip(res['alone_ms'], res['beside_ms'])]}); "
            f"sandbox {statistics.median(res['groups_per_s']):.1f} groups/s meanwhile "
            f"({statistics.median(res['alone_groups_per_s']):.1f} alone); the pool model predicts "
            f"{pool_slowdown(threads, slots, os.cpu_count() or 2):.2f}x",
            flush=True,
        )
    print(json.dumps({"cores": os.cpu_count(), "rounds": args.rounds, "phase_s": args.phase_s, "results": results}))


if __name__ == "__main__":
    main()
