"""Multi-turn episodes in the pipeline: asynchronous against synchronous, turns against waves.

    PYTHONPATH=src python bench/agentic.py [--steps 8] [--latencies 0,0.1,0.5,step] [--budget 1] [--tasks tool_use]
                                           [--latency-sigma 1.0] [--cpus 1]

Workload: the tool_use task as tests/integration/test_tool_learning.py trains it (a 2-layer 64-wide
model warm-started on an imperfect teacher's transcripts, 4 prompts, 4 groups of 8 episodes per
step, up to 3 model turns, real sandbox sessions: mean reward about 0.5, so groups train
with a signal; on 64 prompts this tiny model answers none right), `tools.latency_s` added to
every tool call without CPU (a remote tool or a slow sandbox); with --latency-sigma S each call
waits a lognormal time of that mean and shape S instead (a heavy tail at 1: where lock-step
waves wait for the slowest call of every turn and turn scheduling does not); `repo` with
--tasks tool_use,repo.
`tools.sessions` is set to a step's episodes, so a lock-step wave is a whole step and the
waves/turns figure measures scheduling alone, not session concurrency. Latency 'step' is chosen
after the first run: the measured compute C of a synchronous step (below), so that the tool
latency a step waits for is about as long as its compute.

Per latency, three `gapless train` runs in their own processes, same seed and cached warm start:
    sync_turns   pipeline.max_staleness = 0, turn scheduling (each episode's next turn joins the
                 continuous batch when its tool returns)
    sync_waves   the same with pipeline.turn_schedule = 'waves' (the reference loop's lock-step)
    async        pipeline.max_staleness = --budget, turn scheduling
Figures per run: seconds per trained episode over steps 2..S (step 1 includes starting the
actors), trainer idle and generator idle fractions (means over those steps). Per latency:
async / sync_turns and sync_waves / sync_turns, and the bound max(C, L) / (C + L) for the first,
where C = compute per step = the sync_turns step time at latency 0 (all compute: generation,
tools' own CPU, training) and L = the latency this sync run did not hide = its step time minus C.
Async can at best overlap the two fully: max(C, L) per step against C + L. That bound assumes
the step's compute is serial; on several cores the asynchronous run also overlaps compute with
compute (trainer beside generator and sandbox) and can beat it. --cpus N pins every run (its
actors and sandboxes) to N cores with N threads, so that on one core the bound is a true limit.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = {
    "tool_use": {
        "task.name": "tool_use", "model.hidden_size": "64", "model.num_layers": "2", "model.intermediate_size": "128",
        "model.vocab_size": "320", "tools.num_train_prompts": "4", "tools.num_eval_prompts": "4",
        "tools.skip_frac": "0.4", "tools.typo_frac": "0.2",
        "warmstart.steps": "80", "warmstart.batch_size": "16", "warmstart.lr": "1e-2",
        "generator.group_size": "8", "generator.max_new_tokens": "20", "loop.prompts_per_step": "4",
        "tools.sessions": "32", "trainer.lr": "3e-3",
    },
    "repo": {
        "task.name": "repo", "model.hidden_size": "64", "model.num_layers": "2", "model.intermediate_size": "128",
        "model.vocab_size": "320", "repo.num_train_prompts": "32", "repo.num_eval_prompts": "4",
        "warmstart.steps": "80", "warmstart.batch_size": "16", "warmstart.lr": "1e-2", "repo.max_turns": "4",
        "generator.group_size": "4", "generator.max_new_tokens": "24", "loop.prompts_per_step": "4",
        "repo.sessions": "16", "trainer.lr": "3e-3",
    },
}  # fmt: skip
LATENCY_KEY = {"tool_use": "tools.latency_s", "repo": "repo.latency_s"}


def run_job(task: str, mode: str, latency_s: float, budget: int, steps: int, out: Path, sigma: float = 0.0,
            cpus: int = 0) -> dict:
    run_dir = out / f"{task}-{mode}-{latency_s:g}-{time.monotonic_ns()}"
    overrides = {"loop.steps": str(steps), "loop.eval_every": "100000", "loop.checkpoint_every": "100000",
                 "metrics.tensorboard": "false", **TASKS[task], LATENCY_KEY[task]: str(latency_s),
                 LATENCY_KEY[task].replace("latency_s", "latency_sigma"): str(sigma),
                 "pipeline.max_staleness": str(budget if mode == "async" else 0),
                 "pipeline.turn_schedule": "waves" if mode == "sync_waves" else "turns"}
    if cpus:
        generator = cpus if mode != "async" else max(1, cpus // 2)
        overrides |= {"pipeline.generator_threads": str(generator), "trainer.threads": str(cpus),
                      "pipeline.trainer_threads": str(cpus if mode != "async" else max(1, cpus - generator))}
    args = [sys.executable, "-m", "gapless.cli", "train", "--run-dir", str(run_dir)]
    for key, value in overrides.items():
        args += [f"--{key}", value]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    pin = (lambda: os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cpus]))) if cpus else None
    subprocess.run(args, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   preexec_fn=pin)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in metrics if "perf/step_s" in m][1:]  # step 1 includes the actors' start
    episodes = len(steps_m) * int(TASKS[task]["loop.prompts_per_step"]) * int(TASKS[task]["generator.group_size"])

    def mean(key):
        values = [m[key] for m in steps_m if key in m]
        return sum(values) / len(values) if values else None

    step_s = sum(m["perf/step_s"] for m in steps_m) / len(steps_m)
    return {"task": task, "mode": mode, "latency_s": latency_s, "step_s": step_s,
            "s_per_episode": step_s * len(steps_m) / episodes,
            "trainer_idle_frac": mean("perf/trainer_idle_frac"), "generator_idle_frac": mean("perf/generator_idle_frac"),
            "staleness_max": max(m.get("staleness/max", 0.0) for m in steps_m),
            "reward_mean": mean("rollout/reward_mean"), "tool_calls_mean": mean("rollout/tool_calls_mean"),
            "turns_mean": mean("rollout/turns_mean")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", type=int, default=1)
    parser.add_argument("--latencies", default="0,0.1,0.5,step")
    parser.add_argument("--tasks", default="tool_use")
    parser.add_argument("--latency-sigma", type=float, default=0.0, help="lognormal shape of each tool call's latency")
    parser.add_argument("--cpus", type=int, default=0, help="pin each run to this many cores (0: all)")
    args = parser.parse_args()
    figures: dict = {"steps": args.steps, "budget": args.budget, "latency_sigma": args.latency_sigma, "cores": args.cpus or os.cpu_count(),
                     "tasks": {}}
    with tempfile.TemporaryDirectory(prefix="gapless-agentic-") as tmp:
        for task in args.tasks.split(","):
            runs, compute_s = [], None
            for latency in args.latencies.split(","):
                if latency == "step" and compute_s is None:
                    runs.append(run_job(task, "sync_turns", 0.0, 0, args.steps, Path(tmp), cpus=args.cpus))
                    compute_s = runs[-1]["step_s"]
                latency_s = compute_s if latency == "step" else float(latency)
                for mode in ("sync_turns", "sync_waves", "async"):
                    if mode == "sync_turns" and any(r["mode"] == mode and r["latency_s"] == latency_s for r in runs):
                        continue
                    result = run_job(task, mode, latency_s, args.budget, args.steps, Path(tmp), args.latency_sigma, args.cpus)
                    runs.append(result)
                    if mode == "sync_turns" and latency_s == 0.0:
                        compute_s = result["step_s"]
                    print(f"{task} latency {latency_s * 1e3:6.0f} ms {mode:<10}: {result['s_per_episode'] * 1e3:7.1f} ms/episode "
                          f"step {result['step_s']:.2f} s  trainer idle {result['trainer_idle_frac']:.2f}  "
                          f"generator idle {result['generator_idle_frac'] or 0:.2f}  staleness max {result['staleness_max']:.0f}",
                          flush=True)
            figures["tasks"][task] = {"compute_s": compute_s, "runs": runs, "by_latency": _ratios(runs, compute_s)}
    print(json.dumps(figures))


def _ratios(runs: list[dict], compute_s: float) -> dict:
    out = {}
    for latency_s in sorted({r["latency_s"] for r in runs}):
        at = {r["mode"]: r for r in runs if r["latency_s"] == latency_s}
        sync, waves, lag = at["sync_turns"], at.get("sync_waves"), at.get("async")
        unhidden = max(sync["step_s"] - compute_s, 0.0)
        bound = max(compute_s, unhidden) / (compute_s + unhidden)
        ratio = lag["s_per_episode"] / sync["s_per_episode"] if lag else None
        out[f"{latency_s:g}"] = {
            "async_over_sync": ratio, "bound": bound, "C_s": compute_s, "L_s": unhidden,
            "within_10pct_of_bound": None if ratio is None else ratio <= bound * 1.1,
            "waves_over_turns_sync": waves["s_per_episode"] / sync["s_per_episode"] if waves else None,
        }
    return out


if __name__ == "__main__":
    main()
