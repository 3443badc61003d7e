"""Multi-turn episodes in the pipeline: asynchronous against synchronous, turns against waves.

    PYTHONPATH=src python bench/agentic.py [--steps 8] [--latencies 0,0.1,0.5,step] [--budget 1] [--tasks tool_use]
                                           [--latency-sigma 1.0] [--cpus 1] [--rounds 3]

Workload: the tool_use task as tests/integration/test_tool_learning.py trains it (a 2-layer 64-wide
model warm-started on an imperfect teacher's transcripts, 4 prompts, 4 groups of 8 episodes per
step, up to 3 model turns, real sandbox sessions: mean reward about 0.5, so groups train
with a signal; on 64 prompts this tiny model answers none right), `tools.latency_s` added to
every tool call without CPU (a remote tool or a slow sandbox); with --latency-sigma S each call
waits a lognormal time of that mean and shape S instead (a heavy tail at 1: where lock-step
waves wait for the slowest call of every turn and turn scheduling does not); `repo` with
--tasks tool_use,repo.
`tools.sessions` is set to a step's episodes, so a lock-step wave is a whole step and the
waves/turns figure measures scheduling alone, not session concurrency.

Per latency, three `gapless train` runs in their own processes, same seed and cached warm start:
    sync_turns   pipeline.max_staleness = 0, turn scheduling (each episode's next turn joins the
                 continuous batch when its tool returns)
    sync_waves   the same with pipeline.turn_schedule = 'waves' (the reference loop's lock-step)
    async        pipeline.max_staleness = --budget, turn scheduling
Figures per run: seconds per trained episode over steps 2..S (step 1 includes starting the
actors), CPU seconds per step over the same steps (the run's whole process tree: actors,
sandboxes, read from /proc at each step's metrics line), trainer idle and generator idle
fractions. Per latency: async / sync_turns and sync_waves / sync_turns, and the bound
max(C, L) / (C + L) for the first, from the synchronous run: C = its CPU seconds per step (the
compute: generation, tools' own CPU, training), L = its step time minus C (every wait it did not
hide: the added tool latency and its own waits on processes). Async can at best overlap the two
fully: max(C, L) per step against C + L. On one core (--cpus 1 pins every run, its actors and
sandboxes; each takes one thread, as the config's thread defaults follow the affinity) compute
is serial, so C / (C + L) is a hard limit; on several, the asynchronous run also overlaps
compute with compute and can beat it. async_cpu_over_sync_cpu is the asynchronous run's CPU per
step over the synchronous one's (two processes and weight pushes, but also a policy one
version behind that writes other episodes, and the machine's own noise).
Latency 'step' is the latency per call at which the synchronous step waits about as long as it
computes (L = C): calibrated from the synchronous runs at latency 0 and C / 2 (L is linear in the
latency per call; a step waits for the calls on its slowest episode's path, not for one call).
--rounds R repeats every run R times (the calibrated latency is kept) and reports medians.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tool_use learning workload: tests/integration/test_tool_learning.py imports it, so that the
# bench measures the run whose reward that test checks rises.
TOOL_LEARNING = {
    "task.name": "tool_use", "model.hidden_size": "64", "model.num_layers": "2", "model.intermediate_size": "128",
    "model.vocab_size": "320", "tools.num_train_prompts": "4", "tools.num_eval_prompts": "4",
    "tools.skip_frac": "0.4", "tools.typo_frac": "0.2",
    "warmstart.steps": "80", "warmstart.batch_size": "16", "warmstart.lr": "1e-2",
    "generator.group_size": "8", "generator.max_new_tokens": "20", "loop.prompts_per_step": "4", "trainer.lr": "3e-3",
}  # fmt: skip
TASKS = {
    "tool_use": {**TOOL_LEARNING, "tools.sessions": "32"},
    "repo": {
        "task.name": "repo", "model.hidden_size": "64", "model.num_layers": "2", "model.intermediate_size": "128",
        "model.vocab_size": "320", "repo.num_train_prompts": "32", "repo.num_eval_prompts": "4",
        "warmstart.steps": "80", "warmstart.batch_size": "16", "warmstart.lr": "1e-2", "repo.max_turns": "4",
        "generator.group_size": "4", "generator.max_new_tokens": "24", "loop.prompts_per_step": "4",
        "repo.sessions": "16", "trainer.lr": "3e-3",
    },
}  # fmt: skip
LATENCY_KEY = {"tool_use": "tools.latency_s", "repo": "repo.latency_s"}


def run_job(
    task: str, mode: str, latency_s: float, budget: int, steps: int, out: Path, sigma: float = 0.0, cpus: int = 0
) -> dict:
    run_dir = out / f"{task}-{mode}-{latency_s:g}-{time.monotonic_ns()}"
    overrides = {
        "loop.steps": str(steps),
        "loop.eval_every": "100000",
        "loop.checkpoint_every": "100000",
        "metrics.tensorboard": "false",
        **TASKS[task],
        LATENCY_KEY[task]: str(latency_s),
        LATENCY_KEY[task].replace("latency_s", "latency_sigma"): str(sigma),
        "pipeline.max_staleness": str(budget if mode == "async" else 0),
        "pipeline.turn_schedule": "waves" if mode == "sync_waves" else "turns",
    }
    args = [sys.executable, "-m", "gapless.cli", "train", "--run-dir", str(run_dir)]
    for key, value in overrides.items():
        args += [f"--{key}", value]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    # pinned, the run splits its N cores by itself (config.usable_cores reads the affinity; so does torch)
    pin = (lambda: os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cpus]))) if cpus else None
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=pin)
        cpu_at_step = _watch_cpu(process, run_dir / "metrics.jsonl")
        if process.returncode:
            stderr.seek(0)
            raise RuntimeError(f"{' '.join(args)} failed ({process.returncode}):\n{stderr.read().decode()[-4000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in metrics if "perf/step_s" in m][1:]  # step 1 includes the actors' start
    cpu_steps = sorted(cpu_at_step)
    cpu_per_step = (
        (cpu_at_step[cpu_steps[-1]] - cpu_at_step[cpu_steps[0]]) / (cpu_steps[-1] - cpu_steps[0])
        if len(cpu_steps) > 1
        else None
    )
    episodes = len(steps_m) * int(TASKS[task]["loop.prompts_per_step"]) * int(TASKS[task]["generator.group_size"])

    def mean(key):
        values = [m[key] for m in steps_m if key in m]
        return sum(values) / len(values) if values else None

    step_s = sum(m["perf/step_s"] for m in steps_m) / len(steps_m)
    return {"task": task, "mode": mode, "latency_s": latency_s, "step_s": step_s, "cpu_s_per_step": cpu_per_step,
            "s_per_episode": step_s * len(steps_m) / episodes,
            "trainer_idle_frac": mean("perf/trainer_idle_frac"), "generator_idle_frac": mean("perf/generator_idle_frac"),
            "staleness_max": max(m.get("staleness/max", 0.0) for m in steps_m),
            "reward_mean": mean("rollout/reward_mean"), "tool_calls_mean": mean("rollout/tool_calls_mean"),
            "turns_mean": mean("rollout/turns_mean")}  # fmt: skip


def _tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by `root` and every live descendant, with the descendants they have
    reaped (utime + stime + cutime + cstime of each: a finished sandbox counts in its reaper)."""
    parent, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])
    in_tree, changed = {root}, True
    while changed:  # to a fixed point: pids wrap, so a child's may be lower than its parent's
        changed = False
        for pid, ppid in parent.items():
            if ppid in in_tree and pid not in in_tree:
                in_tree.add(pid)
                changed = True
    return sum(ticks.get(pid, 0) for pid in in_tree) / os.sysconf("SC_CLK_TCK")


def _watch_cpu(process: subprocess.Popen, metrics: Path, every_s: float = 0.05) -> dict[int, float]:
    """Wait for `process`, sampling its tree's CPU seconds each time metrics.jsonl gains a step
    line: {step: CPU seconds used by the end of that step} (to about `every_s`)."""
    at, seen = {}, 0
    while process.poll() is None:
        try:
            steps = sum(1 for line in metrics.read_text().splitlines() if '"perf/step_s"' in line)
        except OSError:
            steps = 0
        if steps > seen:
            at[steps], seen = _tree_cpu_s(process.pid), steps
        time.sleep(every_s)
    return {step: cpu for step, cpu in at.items() if step >= 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", type=int, default=1)
    parser.add_argument("--latencies", default="0,0.1,0.5,step")
    parser.add_argument("--tasks", default="tool_use")
    parser.add_argument("--latency-sigma", type=float, default=0.0, help="lognormal shape of each tool call's latency")
    parser.add_argument("--cpus", type=int, default=0, help="pin each run to this many cores (0: all)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every run; figures are per round and medians")
    args = parser.parse_args()
    figures: dict = {
        "steps": args.steps,
        "budget": args.budget,
        "latency_sigma": args.latency_sigma,
        "cores": args.cpus or os.cpu_count(),
        "rounds": args.rounds,
        "tasks": {},
    }
    with tempfile.TemporaryDirectory(prefix="gapless-agentic-") as tmp:

        def run(task, mode, latency_s, round_):
            result = run_job(task, mode, latency_s, args.budget, args.steps, Path(tmp), args.latency_sigma, args.cpus)
            result["round"] = round_
            print(
                f"round {round_} {task} latency {latency_s * 1e3:6.0f} ms {mode:<10}: "
                f"{result['s_per_episode'] * 1e3:7.1f} ms/episode step {result['step_s']:.2f} s "
                f"CPU {result['cpu_s_per_step'] or 0:.2f} s  trainer idle {result['trainer_idle_frac']:.2f}  "
                f"generator idle {result['generator_idle_frac'] or 0:.2f}  staleness max {result['staleness_max']:.0f}",
                flush=True,
            )
            return result

        for task in args.tasks.split(","):
            runs, step_latency, calibration = [], None, None
            for round_ in range(1, args.rounds + 1):
                for latency in args.latencies.split(","):
                    if latency == "step" and step_latency is None:
                        step_latency, calibration = _calibrate(lambda x: run(task, "sync_turns", x, round_), runs)
                    latency_s = step_latency if latency == "step" else float(latency)
                    for mode in ("sync_turns", "sync_waves", "async"):
                        done = any(
                            r["mode"] == mode and r["latency_s"] == latency_s and r["round"] == round_ for r in runs
                        )
                        if not done:
                            runs.append(run(task, mode, latency_s, round_))
            figures["tasks"][task] = {
                "step_latency_s": step_latency,
                "calibration": calibration,
                "runs": runs,
                "by_latency": _ratios(runs),
            }
    for task, at in figures["tasks"].items():
        for latency, row in at["by_latency"].items():
            print(
                f"{task} latency {float(latency) * 1e3:6.0f} ms: async / sync {_fmt(row['async_over_sync'])}, "
                f"bound {_fmt(row['bound'])} (C {_fmt(row['C_s'])} s, L {_fmt(row['L_s'])} s), "
                f"async / bound {_fmt(row['async_over_bound'])}, waves / turns {_fmt(row['waves_over_turns_sync'])} "
                f"(medians of {row['rounds']})"
            )
    print(json.dumps(figures))


def _calibrate(sync_at, runs: list[dict]) -> tuple[float, dict]:
    """The tool latency per call at which a synchronous step waits about as long as it computes
    (L = C). L grows linearly with the latency per call x (the calls on a step's critical path):
    one synchronous run at latency 0 and one at C / 2 give the slope; x = (C - L0) / slope."""
    zero = next((r for r in runs if r["mode"] == "sync_turns" and r["latency_s"] == 0.0), None) or sync_at(0.0)
    if zero not in runs:
        runs.append(zero)
    compute, waits = zero["cpu_s_per_step"], zero["step_s"] - zero["cpu_s_per_step"]
    probe = sync_at(round(compute / 2, 3))
    runs.append(probe)
    slope = (probe["step_s"] - probe["cpu_s_per_step"] - waits) / probe["latency_s"]
    latency = round(max(compute - waits, 0.0) / slope, 3) if slope > 0 else compute
    return latency, {
        "C_s": compute,
        "L0_s": waits,
        "probe_latency_s": probe["latency_s"],
        "L_per_latency_s": slope,
        "latency_s": latency,
    }


def _ratios(runs: list[dict]) -> dict:
    """Per latency and round: async / sync_turns, the bound max(C, L) / (C + L) from that round's
    synchronous run (C = its CPU seconds per step, L = its step time minus C: the waits it did not
    hide), async / bound, waves / turns; then the median of each over the rounds."""
    out = {}
    for latency_s in sorted({r["latency_s"] for r in runs}):
        per_round = []
        for round_ in sorted({r["round"] for r in runs if r["latency_s"] == latency_s}):
            at = {r["mode"]: r for r in runs if r["latency_s"] == latency_s and r["round"] == round_}
            sync, waves, lag = at.get("sync_turns"), at.get("sync_waves"), at.get("async")
            if sync is None or sync["cpu_s_per_step"] is None:
                continue
            compute = sync["cpu_s_per_step"]
            unhidden = max(sync["step_s"] - compute, 0.0)
            bound = max(compute, unhidden) / (compute + unhidden)
            ratio = lag["s_per_episode"] / sync["s_per_episode"] if lag else None
            per_round.append({
                "round": round_, "async_over_sync": ratio, "bound": bound, "C_s": compute, "L_s": unhidden,
                "async_over_bound": None if ratio is None else ratio / bound,
                "async_cpu_over_sync_cpu": (lag["cpu_s_per_step"] / compute
                                            if lag and lag["cpu_s_per_step"] else None),
                "waves_over_turns_sync": waves["s_per_episode"] / sync["s_per_episode"] if waves else None,
            })  # fmt: skip
        if per_round:
            medians = {key: _median([row[key] for row in per_round]) for key in per_round[0] if key != "round"}
            out[f"{latency_s:g}"] = {**medians, "rounds": len(per_round), "per_round": per_round}
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
