"""Where the pipeline's actors run and how they talk: placement, names, liveness, weights, ranks, IPC.

`make_placement` is the one place that picks an implementation (local processes, or Ray actors
in cluster/ray/); everything else in this package is the seam or its local implementation, and
never imports Ray.
"""

from __future__ import annotations

from gapless.cluster.placement import LocalPlacement, Placement


def make_placement(cfg, log=print) -> Placement:
    """The placement `cfg.cluster.placement` names; Ray is imported only for 'ray'."""
    if cfg.cluster.placement == "ray":
        from gapless.cluster.ray.placement import RayPlacement

        return RayPlacement(cfg, log)
    return LocalPlacement()
