"""Rounds: one configuration simulated several times with its costs jittered, for the spread
of a prediction. Each figure is reported as its median over the rounds, with its range.

Costs are fitted or derived, never exact, and a pipeline's figures do not always move smoothly
with them: near a regime boundary a small change flips it. docs/simulator.md's heavy tail at
budget 2 on this project's 2-core machine either cycles (the trainer idle 0.45 of the time) or
settles (0.00) depending on a 30% change in one cost, and real runs of it do both, round after
round. One simulation picks one side; rounds with the costs jittered show whether a figure holds
within the costs' uncertainty, or moves by more than the 0.10 that the simulator's accuracy
target allows (`sensitive`), in which case the configuration should be run more than once before
its idle figures are trusted.

    round r:    each cost component (decode, training, scoring CPU, scoring wait, weight relay)
                scaled by its own factor exp(jitter * z), z ~ N(0, 1), drawn from the seed and r
    figure:     median over the rounds, each figure on its own (as bench/pipeline.py reports
                the median of its rounds)
    range:      `<figure>_min` / `_max` for ms per sample, trainer and generator idle, staleness
    sensitive:  1.0 when the trainer's or the generator's idle ranges wider than SENSITIVE_IDLE

Response lengths, prompts and rewards are not jittered (a seed fixes a real run's tasks too).
Guaranteed: deterministic for a config, costs and seed; one round without jitter is the plain
simulation. Not guaranteed: that the jitter has the machine's shape (one independent lognormal
factor per component and round; noise from step to step within a run is not modelled), or that
the median of jittered rounds is closer to a measurement than one simulation (on this machine it
was not: docs/simulator.md).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

from gapless.config import Config
from gapless.simulate.costs import Costs
from gapless.simulate.run import SimResult, Simulation

SPREAD_KEYS = ("s_per_sample", "trainer_idle_frac", "generator_idle_frac", "staleness_mean")
SENSITIVE_IDLE = 0.10  # an idle figure whose rounds range wider than this is not predicted within 0.10


def jittered(costs: Costs, jitter: float, rng: random.Random) -> Costs:
    """`costs` with each component scaled by its own lognormal factor (median 1, shape `jitter`)."""
    if jitter <= 0:
        return costs
    g, t, e, w, r = (math.exp(jitter * rng.gauss(0.0, 1.0)) for _ in range(5))
    gen = costs.generation
    return replace(
        costs,
        generation=replace(gen, step_s=gen.step_s * g, row_s=gen.row_s * g, prefill_token_s=gen.prefill_token_s * g),
        trainer=replace(costs.trainer, token_s=costs.trainer.token_s * t, step_s=costs.trainer.step_s * t),
        env=replace(
            costs.env,
            cpu_s=costs.env.cpu_s * e,
            wait_p50_s=costs.env.wait_p50_s * w,
            wait_p99_s=costs.env.wait_p99_s * w,
        ),
        relay=replace(costs.relay, latency_s=costs.relay.latency_s * r, bytes=costs.relay.bytes * r),
    )


def round_costs(costs: Costs, jitter: float, seed: int, rounds: int) -> list[Costs]:
    """The costs of each round (round r's factors depend only on the seed and r)."""
    return [jittered(costs, jitter, random.Random(f"{seed}-round-{r}")) for r in range(rounds)]


@dataclass
class Rounds:
    summaries: list[dict[str, float]]  # one per round

    def summary(self) -> dict[str, float]:
        """Each figure's median over the rounds; with more than one round, `<figure>_min` / `_max`
        for SPREAD_KEYS and `sensitive` = 1.0 when an idle figure ranges wider than SENSITIVE_IDLE."""
        keys = [k for k in self.summaries[0] if all(k in s for s in self.summaries)]
        out = {k: statistics.median(s[k] for s in self.summaries) for k in keys}
        if len(self.summaries) > 1:
            out["rounds"] = float(len(self.summaries))
            for key in SPREAD_KEYS:
                values = [s[key] for s in self.summaries]
                out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
            out["sensitive"] = float(
                any(
                    out[f"{k}_max"] - out[f"{k}_min"] > SENSITIVE_IDLE
                    for k in ("trainer_idle_frac", "generator_idle_frac")
                )
            )
        return out

    @property
    def median_round(self) -> int:
        """The round whose ms per sample is the median (the one a run directory shows)."""
        order = sorted(range(len(self.summaries)), key=lambda r: self.summaries[r]["s_per_sample"])
        return order[(len(order) - 1) // 2]


def simulate_rounds(
    cfg: Config, costs: Costs, rounds: int | None = None, jitter: float | None = None, timeline_steps: int | None = 0
) -> tuple[Rounds, list[Costs]]:
    """Simulate `cfg` once per round (simulate.rounds, simulate.cost_jitter unless given)."""
    rounds = cfg.simulate.rounds if rounds is None else rounds
    jitter = cfg.simulate.cost_jitter if jitter is None else jitter
    per_round = round_costs(costs, jitter, cfg.seed, rounds)
    results: list[SimResult] = [Simulation(cfg, c, timeline_steps=timeline_steps).run() for c in per_round]
    return Rounds([r.summary() for r in results]), per_round
