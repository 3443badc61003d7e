"""ray_deaths.death_reason on the exceptions Ray raises for a dead actor: a kill by Ray's memory
monitor keeps the node's memory figures and says what to do; any other death keeps Ray's words.
(tests/integration/test_ray_placement.py triggers the memory monitor for real.)"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from gapless.cluster.ray.deaths import death_reason, is_memory_kill  # noqa: E402

# the head of the text Ray 2.60's raylet writes for a worker its memory monitor killed
OOM_TEXT = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.7, ID: "
    "d235f0) was 22.91GB used / 23.59GB limit (0.971159)\nOOM kill reason: Memory usage 24600000000B exceeded "
    "threshold of 24060000000B (95.0% of 25324953600B limit)\nObject store memory usage: [- objects spillable: 0\n"
)


def test_a_memory_monitor_kill_names_the_figures_and_the_fix():
    exc = ray.exceptions.OutOfMemoryError(OOM_TEXT)
    why = death_reason(exc)
    assert is_memory_kill(exc) and why.startswith("was killed by Ray's memory monitor")
    assert "was 22.91GB used / 23.59GB limit (0.971159)" in why and "exceeded threshold of 24060000000B" in why
    assert "RAY_memory_usage_threshold" in why and "Object store" not in why


def test_another_death_keeps_rays_words():
    why = death_reason(ray.exceptions.ActorDiedError())
    assert not is_memory_kill(ray.exceptions.ActorDiedError())
    assert why.startswith("died in Ray (ActorDiedError: The actor died unexpectedly")
