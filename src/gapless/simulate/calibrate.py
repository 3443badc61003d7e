"""Calibration: fit the cost models to real runs of this machine, by simulating those runs.

`gapless simulate --calibrate RUN_DIR [RUN_DIR ...]` reads each run directory (config.json,
metrics.jsonl and the timeline's `score` spans, as `gapless train` writes them; docs/observability.md)
and fits a `Costs` (costs.py) for the shared placement on `simulate.cores` cores:

    lengths          from rollout/completion_len_mean and rollout/truncated_frac, less the
                     synthetic stragglers (generator.force_long_every runs to the cap)
    weight relay     mean perf/weight_push_s
    generation, training, scoring
                     start from the direct estimates (busy seconds x threads / work), then
                     repeat: simulate every calibration run, scale each cost by the geometric
                     mean over the runs of measured / simulated (generator busy seconds per
                     step, perf/train_s, scoring seconds per group), so contention between the
                     actors sharing the cores is the simulator's, not a guess
    parallel_efficiency
                     when the runs use different thread counts (budget 0: every core per
                     actor; budget >= 1: half), the value in 0.3..1.0 (0.4, 0.6, 0.8, 1.0, then
                     +-0.1 around the best) whose fitted costs best predict the runs (below)
    OpenMP teams     on: the runs are CPU runs, where torch's decode and training threads slow
                     to one thread's share when the cores are oversubscribed (pool.py)
    decode first     whether a one-thread decode runs at its speed alone beside the trainer and
                     the sandbox, or shares the cores by threads like the other jobs (pool.py): a
                     property of the machine's scheduler (docs/simulator.md: the first on the
                     machine the built-in costs come from, the second on an Intel Xeon), so both
                     are fitted and the one that predicts the runs better is kept
    the choice       of efficiency and rule: the lowest summed error over the runs of (log of
                     predicted / measured ms per trained sample)^2 + (trainer idle error)^2 +
                     (error in the share of time the generator is not decoding)^2
    losses           what oversubscribed cores lose (pool.py's barrier and contention
                     efficiencies) and the sandbox's share of its threads (costs.py
                     sandbox_runnable) stay 1.0 in this fit: it scales each cost by measured /
                     simulated seconds, which absorbs much of them (on runs simulated with
                     losses 0.5 and 0.8 it predicts as well without them)
    joint fit        with `simulate.calibrate_iterations` N > 0, then N Nelder-Mead iterations
                     (minimize.py) over all eight together, from the fit above: decode, training
                     and scoring CPU seconds, the scoring wait without CPU, the parallel
                     efficiency, the two losses and the sandbox's share, minimising the error
                     below plus (log of predicted / measured seconds a group holds its scoring
                     worker)^2 per pipeline run. The fit behind docs/simulator.md's accuracy
                     figures (bench/simulator.py --part error --fit-sandbox-runnable) is this
                     objective on bench/pipeline.py's cells. It starts from each decode rule's
                     best scaling fit (the simplex is local); the result with the lower error
                     is kept, and a start is kept where the simplex found nothing better
    prompt length    the runs' rollout/prompt_len_mean (runs that predate it: simulate.prompt_tokens);
                     a training step costs token_s per padded token position, cut as the trainer
                     cuts it (trainer/micro_batches.py)
    decode step      step_s = 12 x row_s: the fixed part of a step is worth about 12 rows on
                     this machine (docs/engine.md: a + b x rows, fitted from the continuous and
                     static schedules); only the scale is fitted

Measured from a run the way bench/pipeline.py measures it: steps 2..S (step 1 includes the
actors' start). Guaranteed: the fitted costs pass `Costs.check`. Not guaranteed: that a run on
another machine, or one disturbed by other load, calibrates to the same figures (the docs give
the machine's load during the runs used).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from gapless.config import Config, ConfigError
from gapless.simulate.costs import Costs, EnvCost, GenerationCost, LengthModel, RelayCost, TrainerCost
from gapless.simulate.minimize import nelder_mead
from gapless.simulate.pool import SharedPool
from gapless.simulate.run import Simulation, resolved_threads
from gapless.timeline import read_records

STEP_ROWS = 12.0  # fixed part of a decode step, in rows (docs/engine.md)
EFFICIENCIES = (0.4, 0.6, 0.8, 1.0)  # then +-0.1 around the best
# the joint fit's coordinates: log row_s, log token_s, log cpu_s, parallel efficiency, log scoring
# wait, barrier efficiency, contention efficiency, sandbox share; the first simplex's moves
JOINT_STEP = (0.3, 0.3, 0.6, 0.15, 1.0, 0.3, 0.1, 0.3)
UNITS = (3, 5, 6, 7)  # coordinates that are shares in (0, 1]: clamped to 0.2..1


@dataclass
class Measured:
    """One real run, reduced to what the simulator predicts and what calibration fits."""

    name: str
    cfg: Config  # the run's config, with [simulate] set to replay it on this machine
    steps: int
    s_per_sample: float
    trainer_idle_frac: float
    generator_idle_frac: float  # not decoding: idle or blocked on the environment's queue
    train_s: float  # mean per measured step
    gen_busy_s: float  # mean per measured step
    score_s: float  # mean per group (pipeline) or per step's scoring phase (reference loop)
    push_s: float
    length_mean: float
    truncated_frac: float
    borrowed_frac: float
    prompt_tokens: int  # mean of rollout/prompt_len_mean; 0 where the run did not record it


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def lent_while_scoring(config: dict) -> bool:
    """`pipeline.lend_while_scoring` of a run's config.json. A run from before the field existed
    lent the trainer the generator's cores through the scoring (orchestrate/lending.py)."""
    return bool(config.get("pipeline", {}).get("lend_while_scoring", True))


def read_run(path: str | Path, cores: int) -> Measured:
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except FileNotFoundError as exc:
        raise ConfigError(
            f"--calibrate {path}: not a run directory ({exc.filename} is missing); "
            "pass the RUN_DIR of a `gapless train` run"
        ) from None
    steps = [r for r in records if "perf/step_s" in r]
    if len(steps) < 2:
        raise ConfigError(
            f"--calibrate {path}: {len(steps)} training steps in metrics.jsonl; calibration needs at least 2"
        )
    reference = "perf/generate_s" in steps[0]
    measured = steps[1:]
    raw.pop("simulate", None)
    raw.setdefault("pipeline", {})["lend_while_scoring"] = lent_while_scoring(
        raw
    )  # the rule it ran, not today's default
    cfg = Config.model_validate(raw)
    sim = cfg.simulate.model_copy(
        update={
            "placement": "shared",
            "cores": cores,
            "steps": len(steps),
            "reference_loop": reference,
            "timeline_steps": 0,
        }
    )
    cfg = cfg.model_copy(update={"simulate": sim})
    samples = cfg.loop.prompts_per_step * cfg.generator.group_size
    total = sum(m["perf/step_s"] for m in measured)
    # seconds of each step the generator did not decode: idle, or blocked on the environment's queue
    not_decoding = [
        (m.get("perf/generator_idle_frac", 0) + m.get("perf/generator_blocked_frac", 0)) * m["perf/step_s"]
        for m in measured
    ]
    if reference:
        gen_busy = [m["perf/generate_s"] for m in measured]
        score = [m["perf/score_s"] for m in measured]
    else:
        gen_busy = [m["perf/step_s"] - idle for m, idle in zip(measured, not_decoding)]
        start = measured[0]["time"] - measured[0]["perf/step_s"]
        score = [
            s["end"] - s["start"]
            for s in read_records(path)
            if s.get("actor") == "env" and s.get("name") == "score" and s["start"] >= start
        ]
    return Measured(
        path.name, cfg, len(steps), total / (len(measured) * samples),
        sum(m["perf/trainer_idle_frac"] * m["perf/step_s"] for m in measured) / total, sum(not_decoding) / total,
        _mean([m["perf/train_s"] for m in measured]), _mean(gen_busy), _mean(score),
        _mean([m.get("perf/weight_push_s", 0.0) for m in measured]),
        _mean([m["rollout/completion_len_mean"] for m in measured]), _mean([m["rollout/truncated_frac"] for m in measured]),
        _mean([m.get("perf/trainer_borrowed_frac", 0.0) for m in measured]),
        round(_mean([m["rollout/prompt_len_mean"] for m in measured if "rollout/prompt_len_mean" in m])))  # fmt: skip


def lengths_of(run: Measured, sigma: float = 0.5) -> LengthModel:
    """Response lengths of a run's own sampling, without its synthetic stragglers."""
    cap = run.cfg.generator.max_new_tokens
    every = run.cfg.generator.force_long_every
    forced = 1.0 / every if every else 0.0
    mean = (run.length_mean - forced * cap) / (1 - forced)
    truncated = max((run.truncated_frac - forced) / (1 - forced), 0.0)
    untruncated = (mean - truncated * cap) / (1 - truncated) if truncated < 1 else cap
    return LengthModel(max(untruncated, 1.0), sigma, min(truncated, 1.0))


def simulate_run(run: Measured, costs: Costs, lengths: LengthModel | None = None) -> dict[str, float]:
    """The simulator's figures for one measured run (its config, on its machine)."""
    if lengths is not None:
        costs = replace(costs, lengths=lengths)
    result = Simulation(run.cfg, costs).run()
    steps = result.measured()
    summary = result.summary()
    score = [r.score_s for r in steps if r.score_s > 0]
    if run.cfg.simulate.reference_loop:  # the scoring phase: what is neither generation nor training
        score = [r.step_s - r.gen_busy_s - r.train_s - r.push_s for r in steps]
    return {
        **summary,
        "train_s": _mean([r.train_s for r in steps]),
        "gen_busy_s": _mean([r.gen_busy_s for r in steps]),
        "score_s": _mean(score),
    }


def _gmean(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else 1.0


def initial_costs(runs: list[Measured], cores: int, efficiency: float, decode_first: bool = True) -> Costs:
    """Direct estimates from the first run: busy seconds x speed of its threads / work done."""
    run = runs[0]
    cfg = run.cfg
    pool = SharedPool(cores, efficiency)
    gen_threads, trainer_threads = resolved_threads(cfg, cores)
    lengths = lengths_of(run)
    samples = cfg.loop.prompts_per_step * cfg.generator.group_size
    prompt = run.prompt_tokens or cfg.simulate.prompt_tokens
    tokens = samples * run.length_mean
    decode_steps = cfg.generator.max_new_tokens  # a step's batch fits the engine: it decodes to its longest
    row_s = run.gen_busy_s * pool.speed_of(gen_threads) / (STEP_ROWS * decode_steps + tokens)
    train_speed = pool.speed_of(
        trainer_threads + run.borrowed_frac * (gen_threads if cfg.pipeline.max_staleness else 0)
    )
    token_s = run.train_s * train_speed / (samples * (prompt + run.length_mean))
    cpu_s = max(run.score_s, 1e-4) * 0.5  # refined by simulation
    return Costs(
        GenerationCost(STEP_ROWS * row_s, row_s, 0.0),
        lengths,
        TrainerCost(token_s),
        EnvCost(cpu_s=cpu_s),
        RelayCost(latency_s=run.push_s),
        prompt,
        efficiency,
        source="calibrated",
        barrier_teams=True,
        decode_first=decode_first,
    ).check()  # runs on CPU cores


def fit(runs: list[Measured], cores: int, efficiency: float, decode_first: bool = True, rounds: int = 5) -> Costs:
    costs = initial_costs(runs, cores, efficiency, decode_first)
    for _ in range(rounds):
        predicted = [simulate_run(run, costs, lengths_of(run)) for run in runs]
        gen = _gmean([r.gen_busy_s / p["gen_busy_s"] for r, p in zip(runs, predicted) if p["gen_busy_s"] > 0])
        train = _gmean([r.train_s / p["train_s"] for r, p in zip(runs, predicted) if p["train_s"] > 0])
        delay = [r.cfg.task.score_delay_s for r in runs]
        score = _gmean(
            [
                max(r.score_s - (d if not r.cfg.simulate.reference_loop else 0), 1e-5)
                / max(p["score_s"] - (d if not r.cfg.simulate.reference_loop else 0), 1e-5)
                for r, p, d in zip(runs, predicted, delay)
                if p["score_s"] > 0
            ]
        )
        g, t = costs.generation, costs.trainer
        costs = replace(
            costs,
            generation=GenerationCost(g.step_s * gen, g.row_s * gen, g.prefill_token_s * gen),
            trainer=TrainerCost(t.token_s * train, t.step_s * train),
            env=replace(costs.env, cpu_s=costs.env.cpu_s * score),
        )
    return costs.check()


def point_of(costs: Costs) -> list[float]:
    """The joint fit's coordinates of `costs` (a zero scoring wait starts at 1 ms: its log is a coordinate)."""
    return [
        math.log(costs.generation.row_s),
        math.log(costs.trainer.token_s),
        math.log(costs.env.cpu_s),
        costs.parallel_efficiency,
        math.log(max(costs.env.wait_p50_s, 1e-3)),
        costs.barrier_efficiency,
        costs.contention_efficiency,
        costs.sandbox_runnable,
    ]


def with_point(costs: Costs, x: list[float]) -> Costs:
    """`costs` moved to the coordinates `x` (point_of's inverse, up to the clamped shares)."""
    x = [min(max(v, 0.2), 1.0) if i in UNITS else v for i, v in enumerate(x)]
    g, scale = costs.generation, math.exp(x[0]) / costs.generation.row_s
    wait = math.exp(x[4])
    return replace(
        costs,
        generation=GenerationCost(g.step_s * scale, g.row_s * scale, g.prefill_token_s * scale),
        trainer=TrainerCost(math.exp(x[1]), costs.trainer.step_s),
        env=replace(costs.env, cpu_s=math.exp(x[2]), wait_p50_s=wait, wait_p99_s=wait),
        parallel_efficiency=x[3],
        barrier_efficiency=x[5],
        contention_efficiency=x[6],
        sandbox_runnable=x[7],
    ).check()


def joint_error(runs: list[Measured], costs: Costs) -> float:
    """The joint fit's objective: run_error summed over the runs, plus the squared log error of
    how long a group holds its scoring worker in each pipeline run."""
    total = 0.0
    for run in runs:
        predicted = simulate_run(run, costs, lengths_of(run))
        total += _error(run, predicted)
        if not run.cfg.simulate.reference_loop and run.score_s > 0 and predicted["score_s"] > 0:
            total += math.log(predicted["score_s"] / run.score_s) ** 2
    return total


def refine(runs: list[Measured], costs: Costs, iterations: int) -> tuple[Costs, float, float]:
    """The joint fit from `costs`: (the better of the two, its error, the error of `costs`)."""
    x0 = point_of(costs)
    # a share already at 1 moves down at first: above 1 the clamp is flat and the simplex would stall there
    step = [-s if i in UNITS and x0[i] + s > 1.0 else s for i, s in enumerate(JOINT_STEP)]
    x = nelder_mead(lambda v: joint_error(runs, with_point(costs, v)), x0, step, iterations)
    before, fitted = joint_error(runs, costs), with_point(costs, x)
    after = joint_error(runs, fitted)
    return (fitted, after, before) if after < before else (costs, before, before)


def calibrate(run_dirs: list[str | Path], cores: int = 0, iterations: int = 0) -> tuple[Costs, list[dict]]:
    """Fit costs to `run_dirs`; returns them and, per run, measured against predicted.
    `iterations` > 0: the joint fit of all eight parameters follows (refine)."""
    cores = cores or os.cpu_count() or 2
    runs = [read_run(path, cores) for path in run_dirs]
    threads = {resolved_threads(run.cfg, cores) for run in runs}
    tried: dict[tuple[float, bool], tuple[float, Costs]] = {}

    def attempt(efficiency: float, decode_first: bool) -> None:
        if (efficiency, decode_first) in tried or not 0.3 <= efficiency <= 1.0:
            return
        costs = fit(runs, cores, efficiency, decode_first)
        tried[(efficiency, decode_first)] = (sum(run_error(run, costs) for run in runs), costs)

    for decode_first in (True, False):
        for efficiency in EFFICIENCIES if len(threads) > 1 else (1.0,):
            attempt(efficiency, decode_first)
        if len(threads) > 1:
            coarse = min((e for e, d in tried if d == decode_first), key=lambda e: tried[(e, decode_first)][0])
            attempt(round(coarse - 0.1, 2), decode_first)
            attempt(round(coarse + 0.1, 2), decode_first)
    costs = min(tried.values(), key=lambda pair: pair[0])[1]
    source = "calibrated on " + ", ".join(run.name for run in runs)
    if iterations > 0:  # from each decode rule's best scaling fit: the simplex is local, and the rules far apart
        starts = [
            min((v for k, v in tried.items() if k[1] == rule), key=lambda pair: pair[0])[1] for rule in (True, False)
        ]
        fits = [refine(runs, start, iterations) for start in starts]
        costs, after, before = min(fits, key=lambda fit: fit[1])
        source += (
            f" (joint fit, {iterations} iterations from each decode rule: error {before:.4f} -> {after:.4f}, "
            f"decode first {costs.decode_first})"
        )
    costs = replace(costs, source=source)
    return costs, [compare(run, costs) for run in runs]


def run_error(run: Measured, costs: Costs) -> float:
    """How far the costs predict one run: squared log error of ms per trained sample plus the
    squared errors of the trainer's idle share and of the share of time the generator is not
    decoding (idle or blocked)."""
    return _error(run, simulate_run(run, costs, lengths_of(run)))


def _error(run: Measured, predicted: dict[str, float]) -> float:
    return (
        math.log(predicted["s_per_sample"] / run.s_per_sample) ** 2
        + (predicted["trainer_idle_frac"] - run.trainer_idle_frac) ** 2
        + (predicted["generator_idle_frac"] - run.generator_idle_frac) ** 2
    )


def compare(run: Measured, costs: Costs) -> dict:
    predicted = simulate_run(run, costs, lengths_of(run))
    return {
        "run": run.name,
        "budget": "ref" if run.cfg.simulate.reference_loop else run.cfg.pipeline.max_staleness,
        "measured_ms_per_sample": run.s_per_sample * 1e3,
        "predicted_ms_per_sample": predicted["s_per_sample"] * 1e3,
        "error": predicted["s_per_sample"] / run.s_per_sample - 1,
        "measured_trainer_idle": run.trainer_idle_frac,
        "predicted_trainer_idle": predicted["trainer_idle_frac"],
        "measured_generator_idle": run.generator_idle_frac,
        "predicted_generator_idle": predicted["generator_idle_frac"],
    }
