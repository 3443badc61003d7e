"""A derivative-free minimizer for fitting costs: Nelder-Mead's simplex.

A simulation's figures move in steps with its costs (a group lands on one side of a step's end
or the other), so the loss has no useful gradient; the simplex needs only its values. Used by
calibrate.py's joint fit and by bench/simulator.py's fits on bench/pipeline.py's cells.

Guaranteed: `f` is called at most (len(x0) + 1) + iterations * (len(x0) + 2) times, and the point
returned is the best the simplex holds at the end, so never worse than `x0`. Not guaranteed: a
global minimum, or any bound on the coordinates (clamp them in `f`).
"""

from __future__ import annotations

from typing import Callable


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: list[float], iterations: int) -> list[float]:
    """Minimise `f` from `x0`; the first simplex moves each coordinate by its `step`."""
    simplex = [x0] + [[v + (step[i] if i == j else 0.0) for i, v in enumerate(x0)] for j in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=lambda i: values[i])
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = [sum(p[i] for p in simplex[:-1]) / (len(simplex) - 1) for i in range(len(x0))]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (p - b) for b, p in zip(best, pt)] for pt in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(len(simplex)), key=lambda i: values[i])]
