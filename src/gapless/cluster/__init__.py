"""Where the pipeline's actors run and how they talk: placement, names, liveness, weights, ranks, IPC."""
