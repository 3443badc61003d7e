"""`gapless simulate`: size a cluster for sync or async before renting it (docs/simulator.md).

    gapless simulate [CONFIG] [--section.key VALUE ...]       simulate the job; with sweep lists,
                                                              sweep them and recommend one
    gapless simulate --calibrate RUN_DIR [RUN_DIR ...] [--simulate.costs_path OUT.json]

A simulation writes RUN_DIR (the config's `run_dir`) like a real run (record.py), draws the same
HTML report as `gapless report` into RUN_DIR/report, prints one summary line per swept point,
and ends with one JSON object (the summary, the sweep and the recommendation).

| module | concept |
| --- | --- |
| clock.py | the simulated clock and event loop |
| costs.py | cost models: generation, lengths, scoring, training, weight relay; the roofline |
| pool.py | actors sharing cores (shared placement) |
| engine.py | one generator replica: continuous batching on the simulated clock |
| run.py | the pipeline: real admission, buffer, partial rollouts, curriculum, driven by events |
| calibrate.py | fitting the costs to real runs |
| minimize.py | Nelder-Mead's simplex, for the joint fit |
| sweep.py | the sweep over replicas, trainer ranks, budget, oversampling; the recommendation |
| rounds.py | a configuration simulated over rounds of jittered costs: medians and ranges |
| record.py | the simulated run directory |
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gapless.config import Config, ConfigError
from gapless.simulate.costs import (
    Costs,
    DeviceSpec,
    EnvCost,
    GenerationCost,
    LengthModel,
    RelayCost,
    TrainerCost,
    roofline_costs,
)

# The default cost model of the shared placement: bench/simulator.py's fit (`--part error`, its
# five calibration cells) to one bench/pipeline.py run on the project's 2-core machine (OpenMP
# teams, a one-thread decode served first; the fit and its run are in docs/lab/). token_s is
# 0.921 x the fitted 60.2e-6 because a step is priced by its padded positions (costs.py), not its
# tokens as in the fit: the default task's step (prompts priced at 64 tokens) keeps its cost.
MACHINE_COSTS = Costs(
    GenerationCost(1.022e-3, 85.2e-6),
    LengthModel(8.2, 0.5, 0.0),
    TrainerCost(55.4e-6),
    EnvCost(cpu_s=0.0449, wait_p50_s=0.0073, wait_p99_s=0.0073),
    RelayCost(latency_s=2e-4),
    prompt_tokens=64,
    parallel_efficiency=0.89,
    source="built in: fitted on the first 2-core machine of docs/simulator.md; calibrate on yours",
    barrier_teams=True,
    decode_first=True,
)


def model_size(cfg: Config) -> tuple[float, float]:
    """(parameters, KV bytes per token) of the [model] section, unless [simulate] gives them."""
    m, sim = cfg.model, cfg.simulate
    head_dim = m.hidden_size // m.num_heads
    per_layer = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * m.num_kv_heads * head_dim \
        + 3 * m.hidden_size * m.intermediate_size  # fmt: skip
    params = sim.params or m.num_layers * per_layer + m.vocab_size * m.hidden_size
    kv = sim.kv_bytes_per_token or 2 * m.num_layers * m.num_kv_heads * head_dim * 2
    return params, kv


def resolve_costs(cfg: Config) -> Costs:
    sim = cfg.simulate
    if sim.costs_path:
        path = Path(sim.costs_path)
        if not path.is_file():
            raise ConfigError(
                f"simulate.costs_path: {path} does not exist; write one with "
                "`gapless simulate --calibrate RUN_DIR --simulate.costs_path FILE`"
            )
        return Costs.load(path)
    if sim.placement == "shared":
        return MACHINE_COSTS
    cap = cfg.generator.max_new_tokens
    mean = sim.response_mean or cap / 2
    lengths = LengthModel(mean, sim.response_sigma, sim.truncated_frac)
    expected = sim.truncated_frac * cap + (1 - sim.truncated_frac) * mean
    params, kv = model_size(cfg)
    device = DeviceSpec(sim.device_flops, sim.device_memory_bw, sim.interconnect_bw)
    return roofline_costs(
        device,
        params,
        2.0,
        kv,
        sim.gpus_per_replica,
        sim.prompt_tokens + expected / 2,
        lengths,
        sim.gen_efficiency,
        sim.train_mfu,
        sim.prompt_tokens,
        sim.relay_latency_s,
        sim.decode_step_overhead_s,
    )


def _check(cfg: Config) -> None:
    sim = cfg.simulate
    if cfg.pipeline.partial_rollout_tokens:
        raise ConfigError(
            "pipeline.partial_rollout_tokens is not simulated (the simulator does not track tokens "
            "between events); use pipeline.partial_rollout_s, or set it to 0"
        )
    if (sim.rounds > 1) != (sim.cost_jitter > 0):
        raise ConfigError(
            f"simulate.rounds = {sim.rounds} with simulate.cost_jitter = {sim.cost_jitter:g}: rounds differ "
            "only by their jittered costs; set both (e.g. --simulate.rounds 9 --simulate.cost_jitter 0.1) "
            "or neither"
        )
    if sim.reference_loop and sim.placement == "split":
        raise ConfigError(
            "simulate.reference_loop runs every actor on the same cores: use simulate.placement = 'shared'"
        )


def _check_not_real(run_dir: Path) -> None:
    """A simulation never overwrites a real run (same default run_dir as `gapless train`)."""
    if not (run_dir / "metrics.jsonl").is_file():
        return
    try:
        simulated = json.loads((run_dir / "summary.json").read_text()).get("simulated", False)
    except (FileNotFoundError, json.JSONDecodeError):
        simulated = False
    if not simulated:
        raise ConfigError(
            f"run_dir {str(run_dir)!r} holds a real run; give the simulation its own: --run-dir runs/simulated"
        )


def simulate(cfg: Config, log=print) -> dict:
    """Simulate `cfg` into cfg.run_dir (run files and report), then sweep; returns the summary."""
    from gapless.orchestrate.ledger import GroupLedger
    from gapless.simulate.record import write_run
    from gapless.simulate.rounds import simulate_rounds
    from gapless.simulate.run import Simulation
    from gapless.simulate.sweep import devices, recommend, sweep

    _check(cfg)
    if cfg.simulate.placement == "shared" and not cfg.simulate.cores:
        cfg = cfg.model_copy(update={"simulate": cfg.simulate.model_copy(update={"cores": os.cpu_count() or 2})})
    run_dir = Path(cfg.run_dir)
    _check_not_real(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    costs = resolve_costs(cfg)
    rounds = None
    if cfg.simulate.rounds > 1:  # the run directory shows the median round; the summary is over all
        rounds, per_round = simulate_rounds(cfg, costs)
        costs = per_round[rounds.median_round]
    ledger = GroupLedger(run_dir / "groups.jsonl")
    result = Simulation(cfg, costs, ledger).run()
    write_run(result, run_dir, cfg.model_dump(mode="json"), costs)
    summary = {"devices": devices(cfg), **(rounds.summary() if rounds else result.summary())}
    log(_line("simulated", summary))
    out: dict = {"run_dir": str(run_dir), "costs": costs.source, "summary": summary}
    sim = cfg.simulate
    if sim.sweep_replicas or sim.sweep_trainer_ranks or sim.sweep_budgets or sim.sweep_oversample:
        rows = sweep(cfg, resolve_costs)
        for row in rows:
            log(
                _line(
                    f"replicas {row['replicas']:>4} ranks {row['trainer_ranks']:>4} budget {row['max_staleness']} "
                    f"oversample {row['oversample']:.2f}",
                    row,
                )
            )
        best = recommend(rows, sim.device_budget)
        out.update(sweep=rows, recommended=best)
        if best is None:
            log(f"no swept configuration fits simulate.device_budget = {sim.device_budget} devices")
        else:
            log(
                f"recommended for {sim.device_budget or 'any number of'} devices: {best['replicas']} replicas x "
                f"{sim.gpus_per_replica} devices, {best['trainer_ranks']} trainer ranks, max_staleness "
                f"{best['max_staleness']}, oversample {best['oversample']}"
            )
    from gapless.report import build_report

    out["report"] = str(build_report([run_dir], run_dir / "report"))
    return out


def _line(label: str, s: dict) -> str:
    drops = ", ".join(f"{k[6:]} {v:.0f}" for k, v in s.items() if k.startswith("drops/")) or "none"
    line = (
        f"{label}: {s['s_per_sample'] * 1e3:.3f} ms/sample ({s['samples_per_s']:.1f} samples/s)  trainer idle "
        f"{s['trainer_idle_frac']:.2f}  generator idle {s['generator_idle_frac']:.2f}  staleness "
        f"{s['staleness_mean']:.2f} (max {s['staleness_max']:.0f})  drops: {drops}"
    )
    if "rounds" in s:  # medians over jittered rounds (rounds.py), with their ranges
        line += (
            f"  [median of {s['rounds']:.0f} rounds: ms {s['s_per_sample_min'] * 1e3:.2f}-"
            f"{s['s_per_sample_max'] * 1e3:.2f}, trainer idle {s['trainer_idle_frac_min']:.2f}-"
            f"{s['trainer_idle_frac_max']:.2f}, generator idle {s['generator_idle_frac_min']:.2f}-"
            f"{s['generator_idle_frac_max']:.2f}{'; idle moves > 0.10 within the jitter' if s['sensitive'] else ''}]"
        )
    return line


def calibrate_command(run_dirs: list[str], cfg: Config, log=print) -> dict:
    """Fit the costs to `run_dirs` and write them to simulate.costs_path (default: FIRST_RUN_DIR/costs.json)."""
    from gapless.simulate.calibrate import calibrate

    costs, rows = calibrate(run_dirs, cfg.simulate.cores, cfg.simulate.calibrate_iterations)
    out = Path(cfg.simulate.costs_path or Path(run_dirs[0]) / "costs.json")
    out.write_text(costs.to_json())
    for row in rows:
        log(
            f"{row['run']}: measured {row['measured_ms_per_sample']:.2f} ms/sample, predicted "
            f"{row['predicted_ms_per_sample']:.2f} ({row['error']:+.1%}); trainer idle {row['measured_trainer_idle']:.2f} / "
            f"{row['predicted_trainer_idle']:.2f}, generator idle {row['measured_generator_idle']:.2f} / "
            f"{row['predicted_generator_idle']:.2f}"
        )
    log(f"{costs.source}; costs written to {out}; use them with --simulate.costs_path {out}")
    return {"costs_path": str(out), "runs": rows}


def main(argv: list[str], load) -> int:
    """The `gapless simulate` command; `load` parses [CONFIG] and overrides as `gapless train` does."""
    if "--calibrate" in argv:
        i = argv.index("--calibrate")
        run_dirs = []
        for arg in argv[i + 1 :]:
            if arg.startswith("--"):
                break
            run_dirs.append(arg)
        if not run_dirs:
            raise ConfigError("--calibrate needs at least one RUN_DIR (a `gapless train` run directory)")
        cfg = load(argv[:i] + argv[i + 1 + len(run_dirs) :])
        print(json.dumps(calibrate_command(run_dirs, cfg)))
        return 0
    cfg = load(argv)
    print(json.dumps(simulate(cfg)))
    return 0
