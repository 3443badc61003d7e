"""The names actors go by: in logs, heartbeats, exits, placement.json and the timeline files.

A run with one replica (or one environment actor) names it without a slot number, as no restart
can make a second one; with several, each name carries its slot. Trainer ranks carry their rank.
"""


def replica_name(slot: int, replicas: int) -> str:
    """'generator' when the run has one replica (and no restarts can happen), else 'generator-<slot>'."""
    return "generator" if replicas == 1 else f"generator-{slot}"


def env_name(slot: int, count: int) -> str:
    """'environment' when the run has one environment actor (and none can restart), else
    'environment-<slot>'."""
    return "environment" if count == 1 else f"environment-{slot}"


def rank_name(rank: int) -> str:
    """The trainer's data-parallel rank `rank` (1..W-1) when it runs as an actor."""
    return f"trainer-rank{rank}"
