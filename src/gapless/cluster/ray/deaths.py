"""What a Ray actor's death says, in one diagnosis: Ray's memory monitor's kill told apart from
every other death, with the memory figures Ray reported.

Ray's memory monitor kills a worker when the node's memory use passes `RAY_memory_usage_threshold`
(Ray's default 0.95 of the node's memory), whichever process used the memory: another program on
the box can get a placed actor killed. The call that was running on the actor then fails with
`ray.exceptions.OutOfMemoryError` (later calls with `ActorDiedError`), whose text holds the node's
figures ("Memory on the node (IP: ..., ID: ...) was 22.8GB used / 23.6GB limit (0.96)") and the
reason ("Memory usage ...B exceeded threshold of ...B"). `death_reason` keeps those lines and says
what to do; any other death keeps the first lines of Ray's own message.

Memory monitor of a private instance (`cluster.address` empty: gapless starts Ray itself):
`MONITOR_ENV` raises the kill threshold to 0.98 of the node's memory, so that Ray kills a placed
actor only when the machine is about to run out of memory, not because another process holds a
few GB. A variable already set in the environment (`RAY_memory_usage_threshold`, or
`RAY_memory_monitor_refresh_ms=0` to turn the monitor off) is left as it is. A joined cluster
keeps the settings its nodes were started with.
Not guaranteed: a kill by the kernel's OOM killer (not Ray's) carries no figures: it reads as an
actor that died without a word.
"""

from __future__ import annotations

import re

import ray

MONITOR_ENV = {"RAY_memory_usage_threshold": "0.98"}
OOM_MARKERS = ("low on memory", "memory monitor", "exceeded threshold", "memory usage threshold")
FIGURES = re.compile(r"(Memory on the node \([^)]*\) was [^\n]*|OOM kill reason: [^\n]*)")
MAX_CHARS = 600  # of Ray's own message, for a death that is not the memory monitor's


def is_memory_kill(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, ray.exceptions.OutOfMemoryError) or any(marker in text for marker in OOM_MARKERS)


def death_reason(exc: BaseException) -> str:
    """One diagnosis of the exception a call on a dead actor raised (it completes "gapless-NAME ...")."""
    text = str(exc)
    if is_memory_kill(exc):
        figures = "; ".join(line.strip().rstrip(".") for line in FIGURES.findall(text)) or text[:MAX_CHARS]
        return (
            "was killed by Ray's memory monitor: the node ran short of memory (" + figures + "). Free memory "
            "on the node (another process may hold it), give the actors a node with more memory, or raise "
            "RAY_memory_usage_threshold when starting Ray (RAY_memory_monitor_refresh_ms=0 turns the monitor off)"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"died in Ray ({type(exc).__name__}: {' '.join(lines)[:MAX_CHARS]})"
