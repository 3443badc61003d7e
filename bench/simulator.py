"""The capacity simulator against measurements: bench/pipeline.py's cells, published async
speed-ups, and the speed of a 1,000-GPU simulation.

    PYTHONPATH=src python bench/simulator.py [--part error,builtin,agreement,phases,waits,published,scale] [--measured FILE]
                                             [--lengths-from RUN_DIR] [--runs-dir DIR] [--scale-steps 10000]

error      calibrate on some (workload, budget) cells of bench/pipeline.py, predict the others:
           ms per trained sample, trainer and generator idle (a real generator blocked on its
           full queue to the environment counts as idle: it is not decoding). The measured cells are those of
           docs/lab/2026-11-29-pipeline-sync-async.md (a quiet machine, medians of 3 rounds), or the last
           JSON line of a bench/pipeline.py run (--measured FILE), or the mean of several runs
           (--measured A,B: geometric mean ms, mean idle, per cell). The fit: machine costs
           (decode row cost, trainer cost per token, scoring CPU per group and the part of
           scoring that waits without CPU, parallel efficiency) minimise the squared log error
           of ms/sample plus the squared idle error over the calibration cells (Nelder-Mead on
           the simulator itself). Lengths of the default workload come from a
           run's metrics (--lengths-from) or the measured figures built in (mean 8.3 tokens); the
           heavy-tailed workload has the same natural lengths, none of which reach its 192-token
           cap (measured: its runs' truncated share is exactly the forced stragglers' 1/8).
           --calibrate-all fits every cell of the run instead (--write-costs FILE keeps the costs,
           to be tested on other runs with --part builtin --costs FILE); --fair-decode fits the
           model in which the one-thread decode is not served first (simulate/pool.py);
           --choose-decode-rule fits both and keeps the one with the lower calibration loss;
           --restarts N fits N more times, each from the last fit's costs with a fresh simplex
           (Nelder-Mead's simplex shrinks around a point that need not be the best near it),
           --start FILE starts from fitted costs instead of the defaults.
builtin    every cell of a bench/pipeline.py run (--measured FILE) predicted with the built-in
           costs (or --costs FILE), no fit to that run: a held-out check. Budgets 'B:MODE'
           (pipeline.admit_while_training) are predicted in that mode, and 'B:on' / 'B' ratios are printed.
           --rounds R --jitter J (here and in the error part's predictions): each figure the median
           of R simulations with costs jittered by J (simulate/rounds.py), as the benchmark's
           figure is the median of its rounds.
agreement  one real run against another (--measured FILE --other FILE): the other run's figures
           as the prediction, counted against the same bars; how far the benchmark itself moves
           between runs, which bounds what any calibrated model can show.
phases     where each cell's time goes, measured against simulated: the generator's decode and the
           trainer's training seconds per step, from the timelines a `bench/pipeline.py --keep DIR`
           run left (--runs-dir DIR; median of its rounds) and from the simulation of the cell.
waits      in how many steps after the first the trainer waited (more than 5% of the step), in each
           round of the --keep runs (--runs-dir A,B) and in the simulation of every pipelined cell:
           whether a cell's rounds settle into one rhythm, as one simulation does, or switch.
published  AReaL (1.5B and 7B, 1,000 PPO steps) and PipelineRL setups from their papers and
           READMEs (docs/simulator.md has the sources): the simulator's async/sync time ratio
           against the reported speed-up, with roofline costs of an H800/H100.
scale      a 1,000-GPU split (96 replicas x 8 GPUs + 232 trainer ranks) simulated for
           --scale-steps steps; prints its wall seconds and groups per second.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gapless.config import load_config  # noqa: E402
from gapless.simulate import resolve_costs  # noqa: E402
from gapless.simulate.calibrate import lent_while_scoring  # noqa: E402
from gapless.simulate.costs import Costs, EnvCost, GenerationCost, LengthModel, RelayCost, TrainerCost  # noqa: E402
from gapless.simulate.minimize import nelder_mead  # noqa: E402
from gapless.simulate.rounds import simulate_rounds  # noqa: E402
from gapless.simulate.run import Simulation  # noqa: E402

WORKLOADS = {  # bench/pipeline.py's workloads
    "default": {},
    "heavy_tail": {"generator.force_long_every": "8", "generator.max_new_tokens": "192"},
    "latency": {"task.score_delay_s": "0.1"},
    "latency_200ms": {"task.score_delay_s": "0.2"},
}
BUDGETS = ["ref", "0", "1", "2", "4"]
# docs/lab/2026-11-29-pipeline-sync-async.md, bench/pipeline.py --steps 12 --rounds 3, 2026-11-29 18:38-19:20 UTC, no other jobs
DOCS_MEASURED = {
    "default": {
        "ms": [5.55, 5.99, 6.12, 6.79, 5.71],
        "trainer_idle": [0.49, 0.51, 0.00, 0.00, 0.00],
        "generator_idle": [0.91, 0.73, 0.77, 0.78, 0.59],
    },
    "heavy_tail": {"ms": [10.97, 11.47, 10.81, 10.61, 12.09]},
    "latency": {"ms": [8.72, 8.86, 6.76, 6.82, 6.71]},
    "latency_200ms": {"ms": [11.38, 11.44, 7.92, 7.81, 6.50]},
}
CALIBRATION = [("default", "ref"), ("default", "0"), ("default", "1"), ("latency_200ms", "1"), ("heavy_tail", "0")]


# the default task's training prompts under its warm-started tokenizer: 23.8 tokens on average
# (runs from before rollout/prompt_len_mean was recorded do not say)
DEFAULT_PROMPT_TOKENS = 24
STEPS = 12  # per simulated cell, as bench/pipeline.py's documented runs (--steps 12)


def cell_config(workload: str, budget: str, steps: int = STEPS, admit: str = "auto", lend_while_scoring: bool = False):
    """lend_while_scoring: the measured run's pipeline.lend_while_scoring (true for runs from before
    the field existed: bench/pipeline.py records it per cell)."""
    overrides = {
        "loop.steps": str(steps),
        "simulate.cores": "2",
        "simulate.timeline_steps": "0",
        **WORKLOADS[workload],
        "pipeline.admit_while_training": json.dumps(admit),
        "pipeline.lend_while_scoring": json.dumps(lend_while_scoring),
    }
    if budget == "ref":
        overrides["simulate.reference_loop"] = "true"
    else:
        overrides["pipeline.max_staleness"] = budget
    return load_config(None, overrides)


def cell_costs(costs: Costs, workload: str) -> Costs:
    if workload == "heavy_tail":  # natural responses stop long before 192 tokens; the stragglers are forced
        return replace(costs, lengths=replace(costs.lengths, truncated_frac=0.0))
    return costs


def run_cell(
    costs: Costs,
    workload: str,
    budget: str,
    admit: str = "auto",
    timeline_steps: int | None = None,
    lend_while_scoring: bool = False,
):
    """The simulation of one bench/pipeline.py cell (a SimResult; spans kept for `timeline_steps`)."""
    return Simulation(
        cell_config(workload, budget, admit=admit, lend_while_scoring=lend_while_scoring),
        cell_costs(costs, workload),
        timeline_steps=timeline_steps,
    ).run()


def simulate_cell(
    costs: Costs,
    workload: str,
    budget: str,
    admit: str = "auto",
    rounds: int = 1,
    jitter: float = 0.0,
    lend_while_scoring: bool = False,
) -> dict:
    """One cell's summary: one simulation, or the medians of `rounds` with jittered costs (rounds.py)."""
    cfg = cell_config(workload, budget, admit=admit, lend_while_scoring=lend_while_scoring)
    return simulate_rounds(cfg, cell_costs(costs, workload), rounds, jitter)[0].summary()


def measured_cells(measured: dict) -> dict:
    cells = {}
    for workload, figures in measured.items():
        for i, budget in enumerate(BUDGETS):
            cell = {
                "ms": figures["ms"][i],
                "lend_while_scoring": figures.get("lend_while_scoring", [True] * len(BUDGETS))[i],
            }
            for key in ("trainer_idle", "generator_idle", "score_span"):
                if key in figures and figures[key][i] is not None:
                    cell[key] = figures[key][i]
            cells[(workload, budget)] = cell
    return cells


def bench_runs(path: str) -> dict:
    """The last JSON line of bench/pipeline.py: runs[workload][budget] -> figures."""
    lines = [line for line in Path(path).read_text().splitlines() if line.startswith("{")]
    runs = json.loads(lines[-1])["runs"]
    for cells in runs.values():
        for cell in cells.values():  # a run from before bench/pipeline.py recorded it: the rule then
            cell["lend_while_scoring"] = bool(cell.get("lend_while_scoring", True))
    return runs


def not_decoding(cell: dict) -> float:
    """A measured cell's generator idle: idle, or blocked on the full queue to the environment
    (the simulator has no such queue: its generator idles instead)."""
    return (cell["generator_idle_frac"] or 0.0) + (cell.get("generator_blocked_frac") or 0.0)


def from_bench_json(path: str) -> dict:
    """bench/pipeline.py's cells in the layout of DOCS_MEASURED."""
    runs = bench_runs(path)
    return {
        w: {
            "ms": [runs[w][b]["s_per_sample"] * 1e3 for b in BUDGETS],
            "trainer_idle": [runs[w][b]["trainer_idle_frac"] for b in BUDGETS],
            "generator_idle": [not_decoding(runs[w][b]) for b in BUDGETS],
            "score_span": [runs[w][b].get("score_span_s") for b in BUDGETS],  # None: not measured
            "lend_while_scoring": [runs[w][b]["lend_while_scoring"] for b in BUDGETS],
        }
        for w in runs
    }


def mean_of_runs(paths: list[str]) -> dict:
    """Several bench/pipeline.py runs' cells as one target: the geometric mean of their ms per
    sample, the mean of each idle fraction and score span (a figure missing from a run is left out)."""
    runs = [from_bench_json(path) for path in paths]
    if len(runs) == 1:
        return runs[0]
    out: dict = {}
    for workload in runs[0]:
        out[workload] = {}
        for key in runs[0][workload]:
            columns = list(zip(*(run[workload][key] for run in runs)))
            if key == "ms":
                out[workload][key] = [math.exp(sum(math.log(v) for v in col) / len(col)) for col in columns]
            elif key == "lend_while_scoring":
                out[workload][key] = [col[0] for col in columns]
                if any(len(set(col)) > 1 for col in columns):
                    raise SystemExit(
                        f"--measured: the runs' {workload} cells were measured with different "
                        "pipeline.lend_while_scoring; average runs of one rule"
                    )
            else:
                out[workload][key] = [
                    (sum(v) / len(v)) if (v := [x for x in col if x is not None]) else None for col in columns
                ]
    return out


def costs_from(
    x: list[float], lengths: LengthModel, prompt_tokens: int, barrier_teams: bool = True, decode_first: bool = True
) -> Costs:
    """x: log row_s, log trainer token_s, log scoring CPU, parallel efficiency, log scoring wait,
    barrier efficiency, contention efficiency (pool.py; the efficiencies clamped to 0.2..1)."""

    def unit(v: float) -> float:
        return min(max(v, 0.2), 1.0)

    row_s, token_s, cpu_s, efficiency = math.exp(x[0]), math.exp(x[1]), math.exp(x[2]), unit(x[3])
    wait_s = math.exp(x[4])  # the part of scoring a group that holds its worker without CPU
    return Costs(
        GenerationCost(12 * row_s, row_s),
        lengths,
        TrainerCost(token_s),
        EnvCost(cpu_s=cpu_s, wait_p50_s=wait_s, wait_p99_s=wait_s),
        RelayCost(latency_s=2e-4),
        prompt_tokens=prompt_tokens,
        parallel_efficiency=efficiency,
        barrier_teams=barrier_teams,
        decode_first=decode_first,
        barrier_efficiency=unit(x[5]),
        contention_efficiency=unit(x[6]),
        sandbox_runnable=unit(x[7]) if len(x) > 7 else 1.0,
    ).check()


def loss(costs: Costs, cells: dict, names) -> float:
    total = 0.0
    for workload, budget in names:
        want = cells[(workload, budget)]
        got = simulate_cell(costs, workload, budget, lend_while_scoring=want["lend_while_scoring"])
        total += math.log(got["s_per_sample"] * 1e3 / want["ms"]) ** 2
        for key in ("trainer_idle", "generator_idle"):
            if key in want:
                total += (got[f"{key}_frac"] - want[key]) ** 2
        if "score_span" in want and budget != "ref" and got["score_span_s"] > 0:  # how long a group holds its worker
            total += math.log(got["score_span_s"] / want["score_span"]) ** 2
    return total


def point_of(costs: Costs, runnable: bool = False) -> list[float]:
    """The fit's coordinates of costs (costs_from's inverse, up to the clamped efficiencies)."""
    return [
        math.log(costs.generation.row_s),
        math.log(costs.trainer.token_s),
        math.log(costs.env.cpu_s),
        costs.parallel_efficiency,
        math.log(costs.env.wait_p50_s),
        costs.barrier_efficiency,
        costs.contention_efficiency,
    ] + ([costs.sandbox_runnable] if runnable else [])


def part_error(
    measured: dict,
    lengths: LengthModel,
    prompt_tokens: int,
    iterations: int,
    barrier_teams: bool = True,
    calibration=CALIBRATION,
    decode_first: bool | None = True,
    rounds: int = 1,
    jitter: float = 0.0,
    start: Costs | None = None,
    restarts: int = 0,
    runnable: bool = False,
) -> dict:
    """Fit the costs to the calibration cells (one simulation each), then predict every cell (the
    median of `rounds` with jittered costs, when given). `decode_first` None: fit both decode
    rules and keep the one with the lower loss on the calibration cells. `start`: begin at these
    costs (and their decode rule) instead of the defaults; `restarts`: fit again from the result
    that many times (its rule kept)."""
    cells = measured_cells(measured)
    calibration = list(cells) if calibration == "all" else calibration
    x0 = [math.log(8e-5), math.log(7e-5), math.log(0.02), 0.9, math.log(0.005), 0.8, 0.95] + ([1.0] if runnable else [])
    step = [0.3, 0.3, 0.6, 0.15, 1.0, 0.3, 0.1] + ([-0.3] if runnable else [])  # into (0, 1]: the clamp is flat above
    if start is not None:
        x0, decode_first = point_of(start, runnable), start.decode_first

    def fit(start_x: list[float], rule: bool) -> tuple[float, Costs]:
        x = nelder_mead(
            lambda v: loss(costs_from(v, lengths, prompt_tokens, barrier_teams, rule), cells, calibration),
            start_x,
            step,
            iterations,
        )
        costs = costs_from(x, lengths, prompt_tokens, barrier_teams, rule)
        return loss(costs, cells, calibration), costs

    fits = []
    for rule in (True, False) if decode_first is None else (decode_first,):
        fits.append(fit(x0, rule))
        print(f"decode first {rule}: calibration loss {fits[-1][0]:.4f}", flush=True)
    costs = min(fits, key=lambda pair: pair[0])[1]
    for restart in range(restarts):
        value, costs = fit(point_of(costs, runnable), costs.decode_first)
        print(f"restart {restart + 1}: calibration loss {value:.4f}", flush=True)
    rows = []
    for (workload, budget), want in cells.items():
        got = simulate_cell(
            costs, workload, budget, rounds=rounds, jitter=jitter, lend_while_scoring=want["lend_while_scoring"]
        )
        row = {
            "workload": workload,
            "budget": budget,
            "role": "calibration" if (workload, budget) in calibration else "test",
            "measured_ms": want["ms"],
            "predicted_ms": got["s_per_sample"] * 1e3,
            "error": got["s_per_sample"] * 1e3 / want["ms"] - 1,
            "predicted_trainer_idle": got["trainer_idle_frac"],
            "predicted_generator_idle": got["generator_idle_frac"],
            "staleness_mean": got["staleness_mean"],
            "predicted_score_span_s": got["score_span_s"],
        }
        if "score_span" in want:
            row["measured_score_span_s"] = want["score_span"]
        for key in ("trainer_idle", "generator_idle"):
            if key in want:
                row[f"measured_{key}"] = want[key]
        rows.append(row)
        print(
            f"{workload:<14} {budget:>3} {row['role']:<11} measured {want['ms']:6.2f} predicted {row['predicted_ms']:6.2f} "
            f"({row['error']:+6.1%})  trainer idle {want.get('trainer_idle', float('nan')):.2f}/{got['trainer_idle_frac']:.2f}  "
            f"generator idle {want.get('generator_idle', float('nan')):.2f}/{got['generator_idle_frac']:.2f}  "
            f"score span {want.get('score_span', float('nan')) * 1e3:5.1f}/{got['score_span_s'] * 1e3:5.1f} ms",
            flush=True,
        )
    tests = [r for r in rows if r["role"] == "test"] or rows  # every cell calibrated: the fit's own error
    idle_errors = [
        abs(r[f"predicted_{k}"] - r[f"measured_{k}"])
        for r in tests
        for k in ("trainer_idle", "generator_idle")
        if f"measured_{k}" in r
    ]
    return {
        "costs": json.loads(costs.to_json()),
        "cells": rows,
        "test_max_abs_error": max(abs(r["error"]) for r in tests),
        "test_within_15pct": sum(abs(r["error"]) <= 0.15 for r in tests),
        "tests": len(tests),
        "test_max_idle_error": max(idle_errors, default=None),
    }


# Published setups (docs/simulator.md gives the sources). Model shapes of the Qwen2 family.
PUBLISHED = {
    "AReaL 1.5B (16 nodes, 41.0 h -> 14.8 h)": {
        "reported": 41.0 / 14.8,
        "devices": 128,
        "params": 1.78e9,
        "kv": 28 * 2 * 2 * 128 * 2,
        "prompts": 512,
        "group": 16,
        "max_new_tokens": 27648,
        "mean": 9000,
        "sigma": 0.9,
        "truncated": 0.05,
        "budget": 4,
        "flops": 989e12,
        "bw": 3.35e12,
    },
    "AReaL 7B (24 nodes, 57.7 h -> 25.4 h)": {
        "reported": 57.7 / 25.4,
        "devices": 192,
        "params": 7.6e9,
        "kv": 28 * 4 * 2 * 128 * 2,
        "prompts": 512,
        "group": 16,
        "max_new_tokens": 27648,
        "mean": 9000,
        "sigma": 0.9,
        "truncated": 0.05,
        "budget": 4,
        "flops": 989e12,
        "bw": 3.35e12,
    },
    "PipelineRL 7B (128 H100, ~2x)": {
        "reported": 2.0,
        "devices": 128,
        "params": 7.6e9,
        "kv": 28 * 4 * 2 * 128 * 2,
        "prompts": 512,
        "group": 8,
        "max_new_tokens": 8192,
        "mean": 3000,
        "sigma": 0.9,
        "truncated": 0.05,
        "budget": 4,
        "flops": 989e12,
        "bw": 3.35e12,
    },
}


def published_config(
    setup: dict, placement: str, budget: int, replicas: int, ranks: int, steps: int, decode_step_overhead_s: float = 0.0
):
    return load_config(
        None,
        {
            "simulate.decode_step_overhead_s": str(decode_step_overhead_s),
            "simulate.placement": json.dumps(placement),
            "simulate.cores": str(setup["devices"]),
            "simulate.replicas": str(replicas),
            "simulate.trainer_ranks": str(ranks),
            "simulate.params": str(setup["params"]),
            "simulate.kv_bytes_per_token": str(setup["kv"]),
            "simulate.device_flops": str(setup["flops"]),
            "simulate.device_memory_bw": str(setup["bw"]),
            "simulate.response_mean": str(setup["mean"]),
            "simulate.response_sigma": str(setup["sigma"]),
            "simulate.truncated_frac": str(setup["truncated"]),
            "simulate.prompt_tokens": "256",
            "simulate.timeline_steps": "0",
            "loop.steps": str(steps),
            "loop.prompts_per_step": str(setup["prompts"]),
            "generator.group_size": str(setup["group"]),
            "generator.max_new_tokens": str(setup["max_new_tokens"]),
            "generator.max_batch": "512",
            "pipeline.max_staleness": str(budget),
            "pipeline.lend_idle_cores": "false",
            "task.num_train_prompts": "20000",
            "simulate.trainer_inbox": '"continuous"',
        },
    )  # their rollout controllers admit on their own


def part_published(steps: int, decode_step_overhead_s: float = 0.0) -> dict:
    out = {}
    for name, setup in PUBLISHED.items():
        devices = setup["devices"]
        # synchronous: generation on every device, then training on every device (colocated, shared)
        sync_cfg = published_config(setup, "split", 0, devices, devices, steps, decode_step_overhead_s)
        sync_costs = resolve_costs(sync_cfg)
        sync_cfg = published_config(setup, "shared", 0, devices, devices, steps, decode_step_overhead_s)
        sync = Simulation(sync_cfg, replace(sync_costs, parallel_efficiency=1.0)).run().summary()
        best = None
        for gen_share in (0.5, 0.625, 0.75, 0.875):  # asynchronous: devices split between generation and training
            replicas = round(devices * gen_share)
            cfg = published_config(
                setup, "split", setup["budget"], replicas, devices - replicas, steps, decode_step_overhead_s
            )
            result = Simulation(cfg, resolve_costs(cfg)).run().summary()
            if best is None or result["s_per_sample"] < best[1]["s_per_sample"]:
                best = (gen_share, result)
        ratio = sync["s_per_sample"] / best[1]["s_per_sample"]
        out[name] = {
            "reported_speedup": setup["reported"],
            "simulated_speedup": ratio,
            "error": ratio / setup["reported"] - 1,
            "async_generation_share": best[0],
            "sync_s_per_step": sync["s_per_sample"] * setup["prompts"] * setup["group"],
            "async_s_per_step": best[1]["s_per_sample"] * setup["prompts"] * setup["group"],
            "sync_trainer_idle": sync["trainer_idle_frac"],
            "async_trainer_idle": best[1]["trainer_idle_frac"],
            "async_generator_idle": best[1]["generator_idle_frac"],
        }
        print(
            f"{name}: reported {setup['reported']:.2f}x, simulated {ratio:.2f}x ({ratio / setup['reported'] - 1:+.0%}); "
            f"sync {out[name]['sync_s_per_step']:.0f} s/step, async {out[name]['async_s_per_step']:.0f} s/step "
            f"with {best[0]:.0%} of the devices generating",
            flush=True,
        )
    return out


def part_scale(steps: int) -> dict:
    cfg = load_config(
        None,
        {
            "simulate.placement": '"split"',
            "simulate.replicas": "96",
            "simulate.gpus_per_replica": "8",
            "simulate.trainer_ranks": "232",
            "loop.steps": str(steps),
            "loop.prompts_per_step": "32",
            "generator.group_size": "16",
            "generator.max_new_tokens": "16384",
            "simulate.params": "7.6e9",
            "simulate.kv_bytes_per_token": str(28 * 4 * 2 * 128 * 2),
            "generator.max_batch": "512",
            "pipeline.max_staleness": "2",
            "task.num_train_prompts": "20000",
            "simulate.timeline_steps": "0",
        },
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    result = Simulation(cfg, resolve_costs(cfg)).run()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    groups = steps * cfg.loop.prompts_per_step
    print(
        f"1,000 GPUs (96 x 8 generating, 232 training), {steps} steps of 32 x 16: {wall:.1f} s wall "
        f"({groups / wall:,.0f} groups/s), {cpu:.1f} s of CPU, {result.sim_s / 3600:.1f} simulated hours",
        flush=True,
    )
    return {
        "gpus": 1000,
        "steps": steps,
        "wall_s": wall,
        "cpu_s": cpu,
        "groups_per_s": groups / wall,
        "simulated_h": result.sim_s / 3600,
        "summary": result.summary(),
        "load_avg_1m": os.getloadavg()[0],
    }


def part_builtin(path: str, costs: Costs | None = None, rounds: int = 1, jitter: float = 0.0) -> dict:
    """A held-out check: every cell of a bench/pipeline.py run (budgets 'B:MODE' in that admission
    mode) against the simulator with its built-in costs, or the given ones (no fit to that run);
    with `rounds`, each predicted figure is the median of that many rounds of jittered costs."""
    from gapless.simulate import MACHINE_COSTS

    costs = costs or MACHINE_COSTS

    def predict(workload: str, label: str, measured: dict) -> dict:
        budget, _, option = label.partition(":")  # an admission mode, or lend-scoring (recorded in the cell)
        return simulate_cell(
            costs,
            workload,
            budget,
            admit=option if option in ("on", "off", "auto") else "auto",
            rounds=rounds,
            jitter=jitter,
            lend_while_scoring=measured["lend_while_scoring"],
        )

    return compare(path, predict)


def part_agreement(path: str, other: str) -> dict:
    """How well one real run predicts another: the other run's measured figures stand in for the
    simulator's, cell by cell. What no model of the machine can beat while the benchmark itself
    moves this much between runs."""
    runs = bench_runs(other)

    def predict(workload: str, label: str, measured: dict) -> dict | None:
        cell = runs.get(workload, {}).get(label)
        if cell is None:  # a cell the other run did not measure (another --budgets list)
            return None
        return {
            "s_per_sample": cell["s_per_sample"],
            "trainer_idle_frac": cell["trainer_idle_frac"],
            "generator_idle_frac": not_decoding(cell),
        }

    return {"predicted_from": other, **compare(path, predict)}


def compare(path: str, predict) -> dict:
    """Every cell of a bench/pipeline.py run against `predict(workload, label, measured cell)` (a summary with
    s_per_sample and the idle fractions, or None to leave the cell out); prints each cell and the
    counts within the issue's bars."""
    rows = []
    for workload, cells in bench_runs(path).items():
        for label, want in cells.items():
            got = predict(workload, label, want)
            if got is None:
                continue
            row = {
                "workload": workload,
                "budget": label,
                "measured_ms": want["s_per_sample"] * 1e3,
                "predicted_ms": got["s_per_sample"] * 1e3,
                "measured_trainer_idle": want["trainer_idle_frac"],
                "predicted_trainer_idle": got["trainer_idle_frac"],
                "measured_generator_idle": not_decoding(want),
                "predicted_generator_idle": got["generator_idle_frac"],
            }
            row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
            rows.append(row)
            print(
                f"{workload:<14} {label:>5} measured {row['measured_ms']:6.2f} predicted {row['predicted_ms']:6.2f} "
                f"({row['error']:+6.1%})  trainer idle {row['measured_trainer_idle']:.2f}/{row['predicted_trainer_idle']:.2f}  "
                f"generator idle {row['measured_generator_idle']:.2f}/{row['predicted_generator_idle']:.2f}",
                flush=True,
            )
    ratios = {}
    for row in rows:
        budget, _, mode = row["budget"].partition(":")
        base = next((r for r in rows if r["workload"] == row["workload"] and r["budget"] == budget), None)
        if mode and base:
            ratios[f"{row['workload']} {row['budget']} / {budget}"] = {
                "measured": row["measured_ms"] / base["measured_ms"],
                "predicted": row["predicted_ms"] / base["predicted_ms"],
            }
    for name, r in ratios.items():
        print(f"{name}: measured {r['measured']:.3f} predicted {r['predicted']:.3f}")
    idle = [
        abs(r[f"predicted_{k}"] - r[f"measured_{k}"])
        for r in rows
        for k in ("trainer_idle", "generator_idle")
        if r[f"measured_{k}"] is not None
    ]
    out = {
        "measured_from": path,
        "cells": rows,
        "ratios": ratios,
        "within_15pct": sum(abs(r["error"]) <= 0.15 for r in rows),
        "cells_n": len(rows),
        "idle_within_0_10": sum(e <= 0.10 for e in idle),
        "idle_n": len(idle),
    }
    print(
        f"{out['within_15pct']} of {len(rows)} cells within 15%, {out['idle_within_0_10']} of {len(idle)} idle figures "
        "within 0.10"
    )
    return out


def busy_per_step(spans, steps: int) -> dict[str, float]:
    """Seconds per trained step that the generator decodes and the trainer trains, between the
    first training step's start and the last one's end. spans: (lane, name, start, end)."""
    trains = sorted((s, e) for lane, name, s, e in spans if lane == "trainer" and name == "train")
    if not trains:
        return {}
    start, end = trains[0][0], trains[-1][1]
    out = {"generate": 0.0, "train": 0.0}
    for lane, name, s, e in spans:
        key = (
            "generate" if lane.startswith("generator") and name == "generate" else "train" if name == "train" else None
        )
        if key and min(e, end) > max(s, start):
            out[key] += min(e, end) - max(s, start)
    return {k: v / steps for k, v in out.items()}


def cell_rounds(runs_dirs: list[str], workload: str, budget: str) -> tuple[list[Path], bool]:
    """The round directories of one plain cell in `bench/pipeline.py --keep` folders, and the
    pipeline.lend_while_scoring they ran under (one rule: rounds of different rules are an error)."""
    dirs = sorted(d for runs in runs_dirs for d in Path(runs).glob(f"{workload}-b{budget}-*"))
    rules = {lent_while_scoring(json.loads((d / "config.json").read_text())) for d in dirs}
    if len(rules) > 1:
        raise SystemExit(
            f"--runs-dir: the {workload} budget-{budget} rounds ran under different "
            "pipeline.lend_while_scoring; give runs of one rule"
        )
    return dirs, rules.pop() if rules else True


def part_phases(runs_dir: str, costs: Costs | None = None) -> dict:
    """Where each cell's time goes, measured against simulated: the generator's decode seconds and
    the trainer's training seconds per step, from the timelines a `bench/pipeline.py --keep DIR`
    run left (median over its rounds) and from the simulation of the same cell."""
    import statistics

    from gapless.simulate import MACHINE_COSTS
    from gapless.timeline import read_records

    costs = costs or MACHINE_COSTS
    rows = []
    for workload in WORKLOADS:
        for budget in BUDGETS[1:]:  # the reference loop keeps no generator timeline
            dirs, lend = cell_rounds([runs_dir], workload, budget)
            measured = []
            for run_dir in dirs:
                steps = json.loads((run_dir / "summary.json").read_text())["steps"]
                records = read_records(run_dir)
                measured.append(busy_per_step([(r["actor"], r["name"], r["start"], r["end"]) for r in records], steps))
            if not measured:
                continue
            result = run_cell(costs, workload, budget, timeline_steps=STEPS, lend_while_scoring=lend)
            simulated = busy_per_step(
                [(lane, n, s, e) for lane, spans in result.spans.items() for n, s, e in spans], STEPS
            )
            row = {
                "workload": workload,
                "budget": budget,
                "rounds": len(measured),
                **{f"measured_{k}_s": statistics.median(m[k] for m in measured) for k in ("generate", "train")},
                **{f"predicted_{k}_s": simulated[k] for k in ("generate", "train")},
            }
            rows.append(row)
            print(
                f"{workload:<14} {budget:>3}  decode s/step measured {row['measured_generate_s']:.3f} predicted "
                f"{row['predicted_generate_s']:.3f} ({row['predicted_generate_s'] / row['measured_generate_s']:.2f}x)  "
                f"training s/step measured {row['measured_train_s']:.3f} predicted {row['predicted_train_s']:.3f} "
                f"({row['predicted_train_s'] / row['measured_train_s']:.2f}x)",
                flush=True,
            )
    return {"runs_dir": runs_dir, "cells": rows}


WAITED = 0.05  # a step in which the trainer waited more than this share of it counts as a wait


def part_waits(runs_dirs: list[str], costs: Costs | None = None) -> dict:
    """In how many steps after the first the trainer waited, in each real round of every pipelined
    cell (the `bench/pipeline.py --keep DIR` runs' metrics) and in the cell's simulation. A cell
    whose rounds settle into one rhythm (bursts: the trainer waits every few steps; a trickle: it
    never does) waits alike in every round; a cell whose rounds switch between the two within a
    round lands between the two rhythms' idle figures, which one simulation, in one rhythm, does not."""
    from gapless.simulate import MACHINE_COSTS

    costs = costs or MACHINE_COSTS
    rows = []
    for workload in WORKLOADS:
        for budget in BUDGETS[2:]:
            dirs, lend = cell_rounds(runs_dirs, workload, budget)
            measured = []
            for run_dir in dirs:
                lines = (run_dir / "metrics.jsonl").read_text().splitlines()
                steps = [row for row in map(json.loads, lines) if "perf/trainer_idle_frac" in row][1:]
                measured.append(sum(row["perf/trainer_idle_frac"] > WAITED for row in steps))
            if not measured:
                continue
            result = run_cell(costs, workload, budget, lend_while_scoring=lend)
            simulated = sum(step.waited_s > WAITED * step.step_s for step in result.steps[1:])
            rows.append(
                {
                    "workload": workload,
                    "budget": budget,
                    "steps": STEPS - 1,
                    "measured": measured,
                    "predicted": simulated,
                }
            )
            print(
                f"{workload:<14} {budget:>3}  steps waited of {STEPS - 1}: rounds {' '.join(map(str, measured))}"
                f"  simulated {simulated}",
                flush=True,
            )
    return {"runs_dirs": runs_dirs, "cells": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="error,published,scale")
    parser.add_argument(
        "--measured",
        default=None,
        help="output of bench/pipeline.py (its last line is used); the error part also takes "
        "several, comma-separated, and fits their mean (mean_of_runs)",
    )
    parser.add_argument("--lengths-from", default=None, help="a run directory of the default workload")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="error part: mean prompt tokens of the runs (default: rollout/prompt_len_mean of "
        "--lengths-from, else 24, the default task's training prompts under its tokenizer)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=60,
        help="error part: Nelder-Mead iterations; fits on every cell (--calibrate-all) need more: "
        "150 lowered one run's loss from 0.36 to 0.28 (docs/simulator.md)",
    )
    parser.add_argument("--published-steps", type=int, default=12)
    parser.add_argument(
        "--decode-step-overhead-s",
        type=float,
        default=0.0,
        help="published setups: fixed time of each decode step (simulate.decode_step_overhead_s)",
    )
    parser.add_argument("--scale-steps", type=int, default=10000)
    parser.add_argument(
        "--fair-share",
        action="store_true",
        help="error part: the pool without OpenMP teams (every job at its share of the cores)",
    )
    parser.add_argument(
        "--choose-decode-rule",
        action="store_true",
        help="error part: fit both decode rules (served first, shared by threads) and keep the one "
        "with the lower loss on the calibration cells, as `gapless simulate --calibrate` does",
    )
    parser.add_argument(
        "--fair-decode",
        action="store_true",
        help="error part: the one-thread decode at its share of the cores, not served first (pool.py)",
    )
    parser.add_argument(
        "--calibrate-all",
        action="store_true",
        help="error part: fit on every cell of the run (test the costs on other runs with --costs)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="error part: fit again from the result this many times (a fresh simplex each time)",
    )
    parser.add_argument(
        "--start", default=None, help="error part: start the fit at these costs (JSON from --write-costs): a restart"
    )
    parser.add_argument(
        "--fit-sandbox-runnable",
        action="store_true",
        help="error part: fit the share of their threads the sandbox's programs count for as an "
        "eighth parameter (costs.py sandbox_runnable; 1.0 otherwise)",
    )
    parser.add_argument("--write-costs", default=None, help="error part: write the fitted costs (JSON) here")
    parser.add_argument(
        "--costs", default=None, help="builtin, phases and waits parts: these costs (JSON), not the built-in ones"
    )
    parser.add_argument(
        "--other", default=None, help="agreement part: another bench/pipeline.py run's output, used as the prediction"
    )
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="phases part: the folder of a bench/pipeline.py --keep run; waits part: one or several, comma-separated",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="builtin and error parts: predict each figure as the median of this many simulations with jittered costs",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="with --rounds: lognormal shape of each cost's factor per round (rounds.py)",
    )
    args = parser.parse_args()
    figures: dict = {"cores": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}
    parts = args.part.split(",")
    if "error" in parts:
        from gapless.simulate.calibrate import lengths_of, read_run

        run = read_run(args.lengths_from, 2) if args.lengths_from else None
        # the default task's lengths, measured (docs/simulator.md), unless a run gives them
        lengths = lengths_of(run) if run else LengthModel(8.3, 0.5, 0.0)
        prompt_tokens = args.prompt_tokens or (run.prompt_tokens if run else 0) or DEFAULT_PROMPT_TOKENS
        measured = mean_of_runs(args.measured.split(",")) if args.measured else DOCS_MEASURED
        figures["error"] = {
            "measured_from": args.measured or "docs/lab/2026-11-29-pipeline-sync-async.md",
            "lengths": lengths.__dict__ | {},
            "prompt_tokens": prompt_tokens,
            **part_error(
                measured,
                lengths,
                prompt_tokens,
                args.iterations,
                not args.fair_share,
                "all" if args.calibrate_all else CALIBRATION,
                None if args.choose_decode_rule else not args.fair_decode,
                args.rounds,
                args.jitter,
                Costs.load(args.start) if args.start else None,
                args.restarts,
                args.fit_sandbox_runnable,
            ),
        }
        figures["error"]["lengths"].pop("_quantiles", None)
        if args.write_costs:
            Path(args.write_costs).write_text(json.dumps(figures["error"]["costs"], indent=2))
    if "builtin" in parts:
        if not args.measured:
            parser.error("--part builtin needs --measured: the output of a bench/pipeline.py run")
        figures["builtin"] = part_builtin(
            args.measured, Costs.load(args.costs) if args.costs else None, args.rounds, args.jitter
        )
    if "agreement" in parts:
        if not (args.measured and args.other):
            parser.error("--part agreement needs --measured and --other: the outputs of two bench/pipeline.py runs")
        figures["agreement"] = part_agreement(args.measured, args.other)
    if "phases" in parts:
        if not args.runs_dir:
            parser.error("--part phases needs --runs-dir: the folder a bench/pipeline.py --keep run filled")
        figures["phases"] = part_phases(args.runs_dir, Costs.load(args.costs) if args.costs else None)
    if "waits" in parts:
        if not args.runs_dir:
            parser.error(
                "--part waits needs --runs-dir: the folders bench/pipeline.py --keep runs filled, comma-separated"
            )
        figures["waits"] = part_waits(args.runs_dir.split(","), Costs.load(args.costs) if args.costs else None)
    if "published" in parts:
        figures["published"] = part_published(args.published_steps, args.decode_step_overhead_s)
    if "scale" in parts:
        figures["scale"] = part_scale(args.scale_steps)
    figures["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
