"""Rounds of jittered costs (simulate/rounds.py): the plain simulation when nothing is jittered,
each round's costs as drawn, medians in closed form, and the sensitivity flag."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from sim_pipelines import G, L, P, config, constant_costs

from gapless.config import ConfigError, load_config
from gapless.simulate import simulate
from gapless.simulate.costs import Costs, EnvCost, GenerationCost, LengthModel, RelayCost, TrainerCost
from gapless.simulate.rounds import jittered, round_costs, simulate_rounds
from gapless.simulate.run import Simulation


def test_one_round_without_jitter_is_the_plain_simulation():
    cfg, c = config(1), constant_costs(0.01, 0.3)
    rounds, per_round = simulate_rounds(cfg, c, 1, 0.0)
    assert per_round == [c]
    assert rounds.summary() == Simulation(cfg, c).run().summary()


def test_each_component_gets_its_own_factor():
    c = Costs(
        GenerationCost(1e-3, 2e-4, 5e-5),
        LengthModel(L, sigma=0.0),
        TrainerCost(3e-5, 0.1),
        EnvCost(cpu_s=0.04, wait_p50_s=0.01, wait_p99_s=0.05),
        RelayCost(latency_s=0.2, bytes=1e6),
    )
    j = jittered(c, 0.3, random.Random(7))
    g = j.generation.row_s / c.generation.row_s
    assert j.generation.step_s / c.generation.step_s == pytest.approx(g)
    assert j.generation.prefill_token_s / c.generation.prefill_token_s == pytest.approx(g)
    t = j.trainer.token_s / c.trainer.token_s
    assert j.trainer.step_s / c.trainer.step_s == pytest.approx(t)
    w = j.env.wait_p50_s / c.env.wait_p50_s
    assert j.env.wait_p99_s / c.env.wait_p99_s == pytest.approx(w)
    factors = [g, t, j.env.cpu_s / c.env.cpu_s, w, j.relay.latency_s / c.relay.latency_s]
    assert len({round(f, 12) for f in factors}) == 5  # independent draws
    assert j.lengths == c.lengths and j.prompt_tokens == c.prompt_tokens  # the tasks are not jittered
    # the factors are lognormal with median 1 and shape 0.3
    logs = [math.log(jittered(c, 0.3, random.Random(i)).trainer.step_s / 0.1) for i in range(4000)]
    assert statistics.mean(logs) == pytest.approx(0.0, abs=0.03)
    assert statistics.stdev(logs) == pytest.approx(0.3, rel=0.05)
    assert round_costs(c, 0.3, 5, 3) == round_costs(c, 0.3, 5, 3)  # deterministic for a seed


def test_medians_in_closed_form():
    # synchronous, split placement: a step is g + T, g = L decode steps. Each round's ms per
    # sample follows from its own factors; the summary is their median, its range their extremes.
    cfg, c = config(0), constant_costs(0.01, 0.3)
    rounds, per_round = simulate_rounds(cfg, c, 7, 0.4)
    expected = [(L * r.generation.step_s + r.trainer.step_s) / (P * G) for r in per_round]
    s = rounds.summary()
    assert s["s_per_sample"] == pytest.approx(statistics.median(expected))
    assert s["s_per_sample_min"] == pytest.approx(min(expected))
    assert s["s_per_sample_max"] == pytest.approx(max(expected))
    assert s["rounds"] == 7
    idle = [L * r.generation.step_s / (L * r.generation.step_s + r.trainer.step_s) for r in per_round]
    assert s["trainer_idle_frac"] == pytest.approx(statistics.median(idle))
    assert rounds.summaries[rounds.median_round]["s_per_sample"] == pytest.approx(statistics.median(expected))


def test_a_configuration_at_a_regime_boundary_is_flagged_sensitive():
    # budget 1, generation g = 0.3 s against training T = 0.3 s: the trainer waits in rounds where
    # g > T and the generator in rounds where T > g; with the costs as given neither does
    cfg, c = config(1), constant_costs(0.03, 0.3)
    plain = simulate_rounds(cfg, c, 9, 0.0)[0].summary()
    assert plain["sensitive"] == 0.0 and plain["trainer_idle_frac_max"] == plain["trainer_idle_frac_min"]
    flagged = simulate_rounds(cfg, c, 9, 0.5)[0].summary()
    assert flagged["sensitive"] == 1.0
    assert flagged["trainer_idle_frac_max"] > 0.10 and flagged["generator_idle_frac_max"] > 0.10


def test_simulate_command_reports_the_rounds(tmp_path):
    lines = []
    cfg = load_config(
        None,
        {
            "run_dir": json.dumps(str(tmp_path / "sim")),
            "loop.steps": "6",
            "simulate.placement": '"shared"',
            "simulate.cores": "2",
            "pipeline.max_staleness": "1",
            "simulate.rounds": "5",
            "simulate.cost_jitter": "0.2",
        },
    )
    out = simulate(cfg, log=lines.append)
    assert out["summary"]["rounds"] == 5
    assert "median of 5 rounds" in lines[0]
    assert (tmp_path / "sim" / "metrics.jsonl").is_file()  # the median round's run directory


@pytest.mark.parametrize("rounds, jitter", [("5", "0"), ("1", "0.2")])
def test_rounds_and_jitter_come_together(tmp_path, rounds, jitter):
    cfg = load_config(
        None, {"run_dir": json.dumps(str(tmp_path / "sim")), "simulate.rounds": rounds, "simulate.cost_jitter": jitter}
    )
    with pytest.raises(ConfigError, match="simulate.rounds .* simulate.cost_jitter"):
        simulate(cfg)
    assert not (tmp_path / "sim").exists()  # refused before anything is written
