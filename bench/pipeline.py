"""Synchronous versus asynchronous pipeline at an equal number of trained samples.

    PYTHONPATH=src python bench/pipeline.py [--steps 20] [--rounds 1] [--budgets 0,1,2,4] [--keep runs/bench-pipeline]
    PYTHONPATH=src python bench/pipeline.py --resummarise runs/bench-pipeline   # the figures of kept runs, again
    PYTHONPATH=src python bench/pipeline.py --resummarise runs/bench-a,runs/bench-b   # medians over both runs' rounds
    PYTHONPATH=src python bench/pipeline.py --budgets 1,1:on,2,2:on --workloads default,heavy_tail   # admission modes
    PYTHONPATH=src python bench/pipeline.py --budgets 1,1:lend-scoring,2,2:lend-scoring,4,4:lend-scoring   # core lending

Workloads (each a set of config overrides on the default job):
  default       the embedded code task as configured (compute-bound on this machine)
  heavy_tail    every 8th group ignores EOS and runs to 8x the usual cap (192 tokens)
  latency       100 ms added to scoring each group, without CPU (a remote judge, a slow start);
                at most sandbox.concurrency (4) groups wait at once, so about 0.4 s per step
  latency_200ms the same with 200 ms: about as long as a step's compute on this machine, where
                hiding it pays most (with latency L and compute C per step, sync takes C + L and
                async at best max(C, L))
Every (workload, budget) is one `gapless train` run in its own process with the same seed and
cached warm start, interleaved round by round (workload-major, budgets rotating) so that other
load on the machine hits every configuration alike. Budget 0 is the synchronous pipeline (its
generator and trainer each get half the cores, as in every budget); 'ref' is the one-process
reference loop, where generation and training take turns with every core -- the fastest
synchronous baseline on a small machine, so async is compared with both.

Per run: wall seconds per trained sample over steps 2..S (step 1 includes starting the actors),
trainer idle, generator idle and generator blocked fractions (shares of the time of those steps:
each step's fraction weighted by its duration, as the simulator computes them; blocked:
waiting for room in the bounded queue to the environment), mean and max staleness,
held-out greedy pass@1 at the end, the environment's wall seconds per scored group (its
timeline's `score` spans over steps 2..S, the added latency included), and the CPU cores the machine was busy over steps 2..S
(/proc/stat sampled every 0.2 s; other tenants included, the machine is meant to be quiet). A
run whose busy cores equal the machine's cores cannot go faster by overlapping its actors: only
less work can, which bounds what asynchrony can win on a small machine. Ratios are async / sync (per baseline) of the same workload,
medians over rounds; a budget 'B:OPTION' is also divided by plain 'B' of the same rounds (printed
above the JSON line).
Latency hidden (per latency workload) = 1 - (async latency-workload time - async default time) /
(sync latency-workload time - sync default time), per trained sample. Also: a weight push (SharedWeights.publish)
against a plain copy of the same weights into preallocated memory (median of 50).
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
import threading
import time
from pathlib import Path

import torch

from gapless.simulate.calibrate import lent_while_scoring
from gapless.timeline import read_records

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "default": {},
    "heavy_tail": {"generator.force_long_every": "8", "generator.max_new_tokens": "192"},
    "latency": {"task.score_delay_s": "0.1"},
    "latency_200ms": {"task.score_delay_s": "0.2"},
}


REFERENCE = """
import sys
from gapless.config import load_config
from gapless.orchestrate.loop import RunLoop
overrides = dict(zip(sys.argv[1::2], sys.argv[2::2]))
RunLoop(load_config(None, overrides), log=lambda *a: None, source="inline").run()
"""


def run_job(workload: str, budget: str, steps: int, out: Path) -> dict:
    """budget: a staleness budget for the pipeline, or 'ref' for the one-process reference loop
    (generation and training take turns, each with every core); 'B:MODE' is budget B with
    pipeline.admit_while_training = MODE, 'B:lend-scoring' budget B with
    pipeline.lend_while_scoring = true (the trainer borrows the generator's cores while groups
    are scored: the rule before 2026-12-06)."""
    label = budget
    run_dir = out / f"{workload}-b{label}-{time.monotonic_ns()}"
    overrides = {
        "run_dir": json.dumps(str(run_dir)),
        "loop.steps": str(steps),
        "loop.eval_every": "100000",
        "loop.checkpoint_every": "100000",
        "metrics.tensorboard": "false",
        **WORKLOADS[workload],
    }
    if budget == "ref":
        args = [sys.executable, "-c", REFERENCE]
        overrides["trainer.threads"] = str(os.cpu_count())
        for key, value in overrides.items():
            args += [key, value]
    else:
        budget, _, option = budget.partition(":")
        overrides["pipeline.max_staleness"] = budget
        if option == "lend-scoring":
            overrides["pipeline.lend_while_scoring"] = "true"
        elif option:
            overrides["pipeline.admit_while_training"] = json.dumps(option)
        args = [sys.executable, "-m", "gapless.cli", "train", "--run-dir", str(run_dir)]
        for key, value in overrides.items():
            if key == "run_dir":
                continue
            args += [f"--{key}", value]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    with BusySampler() as busy:
        subprocess.run(args, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return read_run(run_dir, workload, label, busy)


def read_run(run_dir: Path, workload: str, budget: str, busy: "BusySampler | None" = None) -> dict:
    """One run's figures from its directory (busy cores only when sampled while it ran)."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    all_steps = [m for m in metrics if "perf/step_s" in m]
    steps_m = all_steps[1:]  # step 1 includes the actors' start
    spans = [
        s["end"] - s["start"]
        for s in read_records(run_dir)
        if s.get("actor") == "env" and s.get("name") == "score" and s["start"] >= all_steps[0]["time"]
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    samples = len(steps_m) * config["loop"]["prompts_per_step"] * config["generator"]["group_size"]

    def mean(key):
        values = [m[key] for m in steps_m if key in m]
        return sum(values) / len(values) if values else None

    def share_of_time(key):
        """A per-step fraction over the run: weighted by step time, as the simulator reports it
        (a plain mean of alternating long and short steps, as at budget 1, is not a share of time)."""
        pairs = [(m[key], m["perf/step_s"]) for m in steps_m if key in m]
        total = sum(step_s for _, step_s in pairs)
        return sum(value * step_s for value, step_s in pairs) / total if total > 0 else None

    return {
        "workload": workload, "budget": budget,
        "s_per_sample": sum(m["perf/step_s"] for m in steps_m) / samples,
        "trainer_idle_frac": share_of_time("perf/trainer_idle_frac"),  # the reference loop: time not training
        "generator_idle_frac": share_of_time("perf/generator_idle_frac"),
        "generator_blocked_frac": share_of_time("perf/generator_blocked_frac"),  # waiting for room in a full queue to the environment
        "staleness_mean": mean("staleness/mean"),
        "staleness_max": max(m["staleness/max"] for m in steps_m),
        "pass_at_1_end": summary["eval/pass@1_end"],
        "weight_push_s": mean("perf/weight_push_s"),
        "score_span_s": statistics.mean(spans) if spans else None,  # the reference loop scores in-process: none
        "busy_cores": busy.cores_between(all_steps[0]["time"], all_steps[-1]["time"]) if busy else None,
        "lend_while_scoring": lent_while_scoring(config),
    }  # fmt: skip


class BusySampler:
    """Machine-wide busy CPU seconds (/proc/stat: all but idle and iowait), sampled in a thread."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            fields = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
            self.samples.append((time.time(), (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")))
            if self._stop.wait(self.period_s):
                return

    def cores_between(self, start: float, end: float) -> float:
        def busy_at(t):  # linear interpolation between the samples around t
            for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]):
                if t0 <= t <= t1:
                    return b0 + (b1 - b0) * (t - t0) / (t1 - t0)
            raise ValueError(f"no busy samples around {t}")

        return (busy_at(end) - busy_at(start)) / (end - start)


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo): this project's sessions have run on more than one
    kind of machine, and costs fitted on one do not hold on another (docs/simulator.md)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def autogroup() -> bool | None:
    """Whether the kernel shares the cores among sessions before threads (Linux autogroup; every
    sandbox slot is its own session): one of the machine's properties that decide how the sandbox
    and the torch actors share the cores (docs/simulator.md). None where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def weight_push_vs_copy(repeats: int = 50) -> dict:
    from gapless.cluster.weights import SharedWeights
    from gapless.config import ModelConfig
    from gapless.models import build_tiny

    policy = build_tiny(ModelConfig(), ["def f(x): return x + 1"] * 10, seed=0)
    state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    shared = SharedWeights(state, 0)

    def plain():
        for k, v in state.items():
            target[k].copy_(v)

    copies, pushes = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        shared.publish(state, i + 1)
        t2 = time.perf_counter()
        copies.append(t1 - t0)
        pushes.append(t2 - t1)
    copy_s, push_s = statistics.median(copies), statistics.median(pushes)
    return {
        "plain_copy_s": copy_s,
        "publish_s": push_s,
        "ratio": push_s / copy_s,
        "bytes": sum(v.numel() * v.element_size() for v in state.values()),
    }


def summarise(runs: list[dict], workloads: list[str], budgets: list[int]) -> dict:
    def med(workload, budget, key):
        budget = str(budget)
        values = [r[key] for r in runs if r["workload"] == workload and r["budget"] == budget and r[key] is not None]
        return statistics.median(values) if values else None

    table = {
        w: {b: {k: med(w, b, k) for k in runs[0] if k not in ("workload", "budget")} for b in budgets}
        for w in workloads
    }
    ratios, hidden = {}, {}
    latency_workloads = [w for w in workloads if w.startswith("latency")] if "default" in workloads else []
    for base in [b for b in ("0", "ref") if b in budgets]:
        ratios[f"vs_{base}"] = {
            w: {b: med(w, b, "s_per_sample") / med(w, base, "s_per_sample") for b in budgets if b not in ("0", "ref")}
            for w in workloads
        }
        for lat in latency_workloads:
            added_sync = med(lat, base, "s_per_sample") - med("default", base, "s_per_sample")
            hidden.setdefault(lat, {})[f"vs_{base}"] = {
                b: 1 - (med(lat, b, "s_per_sample") - med("default", b, "s_per_sample")) / added_sync
                for b in budgets
                if b not in ("0", "ref") and added_sync > 0
            }
    # 'B:OPTION' against plain 'B', run side by side (admission modes, lending through the scoring)
    variants = {
        w: {
            b: med(w, b, "s_per_sample") / med(w, b.partition(":")[0], "s_per_sample")
            for b in budgets
            if ":" in b and b.partition(":")[0] in budgets
        }
        for w in workloads
    }
    variants = {w: v for w, v in variants.items() if v}
    return {"runs": table, "async_over_sync_time": ratios, "latency_hidden_frac": hidden,
            "variant_over_plain_time": variants}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--budgets",
        default="ref,0,1,2,4",
        help="staleness budgets; 'ref' = the one-process reference loop; 'B:MODE' = budget B with "
        "pipeline.admit_while_training = MODE (e.g. 1,1:on compares the admission modes side by side); "
        "'B:lend-scoring' = budget B with pipeline.lend_while_scoring = true",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep every run directory under this (ignored) folder, e.g. for gapless simulate --calibrate",
    )
    parser.add_argument(
        "--resummarise",
        default=None,
        help="run nothing: read the run directories --keep runs left in this folder (or these "
        "folders, comma-separated: the medians are then over every round of every run) and "
        "print the figures again (busy cores are not kept)",
    )
    args = parser.parse_args()
    budgets = args.budgets.split(",")
    workloads = args.workloads.split(",")
    if args.resummarise:
        folders = [Path(f) for f in args.resummarise.split(",")]
        runs = [
            read_run(d, *d.name.rsplit("-", 1)[0].rsplit("-b", 1))
            for folder in folders
            for d in sorted(folder.iterdir())
            if (d / "summary.json").exists()
        ]
        runs = [r for r in runs if r["workload"] in workloads and r["budget"] in budgets]
        print(
            json.dumps(
                {
                    "steps": None,
                    "rounds": None,
                    "resummarised_from": args.resummarise,
                    **summarise(runs, workloads, budgets),
                }
            )
        )
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="gapless-bench-") as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for rnd in range(args.rounds):
            order = budgets[rnd % len(budgets) :] + budgets[: rnd % len(budgets)]
            for workload in workloads:
                for budget in order:
                    result = run_job(workload, budget, args.steps, out)
                    runs.append(result)
                    print(
                        f"round {rnd} {workload:<10} budget {budget:>3}: {result['s_per_sample'] * 1e3:6.2f} ms/sample  "
                        f"trainer idle {result['trainer_idle_frac']:.2f}  generator idle {result['generator_idle_frac'] or 0:.2f}  "
                        f"staleness {result['staleness_mean']:.2f} (max {result['staleness_max']:.0f})  "
                        f"busy {result['busy_cores']:.2f} cores  "
                        f"pass@1 {result['pass_at_1_end']:.3f}",
                        flush=True,
                    )
    figures = {
        "steps": args.steps,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "autogroup": autogroup(),
        "load_avg_1m": os.getloadavg()[0],
        **summarise(runs, workloads, budgets),
        "weight_push": weight_push_vs_copy(),
    }
    for workload, ratios in figures["variant_over_plain_time"].items():
        for label, ratio in ratios.items():
            print(
                f"{workload:<14} {label} / {label.partition(':')[0]}: {ratio:.3f} of the time per trained sample "
                f"(median of {args.rounds} rounds)"
            )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
