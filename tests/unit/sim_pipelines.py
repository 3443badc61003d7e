"""Small simulated pipelines whose figures can be computed by hand, shared by the simulator's
tests (test_simulate.py, test_simulate_rounds.py)."""

from __future__ import annotations

from gapless.config import load_config
from gapless.simulate.costs import Costs, EnvCost, GenerationCost, LengthModel, RelayCost, TrainerCost

P, G, L = 4, 2, 10  # groups per step, group size, response length


def constant_costs(decode_step_s: float, train_step_s: float) -> Costs:
    """Every decode step costs the same whatever the batch; every response is L tokens; scoring
    and the weight relay are free; a trainer step costs train_step_s whatever its size."""
    return Costs(
        GenerationCost(decode_step_s, 0.0),
        LengthModel(L, sigma=0.0),
        TrainerCost(0.0, train_step_s),
        EnvCost(),
        RelayCost(),
        prompt_tokens=8,
    ).check()


def config(budget: int, steps: int = 8, **extra: str):
    """The split placement, P groups of G per step, the given staleness budget."""
    overrides = {
        "loop.prompts_per_step": str(P),
        "generator.group_size": str(G),
        "generator.max_new_tokens": "32",
        "generator.max_batch": "256",
        "pipeline.max_staleness": str(budget),
        "loop.steps": str(steps),
        "simulate.placement": '"split"',
        "task.num_train_prompts": "50",
        **extra,
    }
    return load_config(None, overrides)
