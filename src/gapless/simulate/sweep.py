"""Sweep the levers that size a cluster and recommend a configuration for a device budget.

The grid is the product of `simulate.sweep_replicas`, `sweep_trainer_ranks`, `sweep_budgets`
(pipeline.max_staleness) and `sweep_oversample` (pipeline.oversample); an empty list keeps the
config's own value. Each point is one simulation of the job (no ledger file, no timeline).

Recommendation: among the points whose devices (replicas x gpus_per_replica + trainer_ranks in
the split placement; the pool's cores in the shared one) fit `simulate.device_budget`, the one
with the most trained samples per second; points within 2% of it count as equal, and of those
the one with the lowest mean staleness, then the fewest devices, wins (off-policy data and
devices are costs too). Guaranteed: deterministic for a config. Not guaranteed: the optimum
outside the grid.
"""

from __future__ import annotations

import itertools

from gapless.config import Config
from gapless.simulate.rounds import simulate_rounds


def devices(cfg: Config) -> int:
    sim = cfg.simulate
    if sim.placement == "shared":
        return sim.cores
    return sim.replicas * sim.gpus_per_replica + sim.trainer_ranks


def with_levers(cfg: Config, replicas: int, ranks: int, budget: int, oversample: float) -> Config:
    sim = cfg.simulate.model_copy(update={"replicas": replicas, "trainer_ranks": ranks})
    pipeline = cfg.pipeline.model_copy(update={"max_staleness": budget, "oversample": oversample})
    return cfg.model_copy(update={"simulate": sim, "pipeline": pipeline})


def sweep(cfg: Config, resolve_costs) -> list[dict]:
    sim = cfg.simulate
    grid = itertools.product(
        sim.sweep_replicas or [sim.replicas],
        sim.sweep_trainer_ranks or [sim.trainer_ranks],
        sim.sweep_budgets or [cfg.pipeline.max_staleness],
        sim.sweep_oversample or [cfg.pipeline.oversample],
    )
    rows = []
    for replicas, ranks, budget, oversample in grid:
        point = with_levers(cfg, replicas, ranks, budget, oversample)
        rows.append(
            {
                "replicas": replicas,
                "trainer_ranks": ranks,
                "max_staleness": budget,
                "oversample": oversample,
                "devices": devices(point),
                **simulate_rounds(point, resolve_costs(point))[0].summary(),
            }
        )
    return rows


def recommend(rows: list[dict], device_budget: int) -> dict | None:
    fitting = [r for r in rows if not device_budget or r["devices"] <= device_budget]
    if not fitting:
        return None
    best = max(r["samples_per_s"] for r in fitting)
    near = [r for r in fitting if r["samples_per_s"] >= 0.98 * best]
    return min(near, key=lambda r: (r["staleness_mean"], r["devices"], -r["samples_per_s"]))
