"""SWE episodes at scale: start-up, per-tool-call and grading latency, memory per live episode.

    PYTHONPATH=src:tests/unit python bench/swe.py [--sizes 16,64,256] [--rounds 1] [--instances FILE]
                                                  [--grade-concurrency 16]

Workload: N episodes at once (one thread each) over one instance (`--instances`: its first line;
default: the tiny package of tests/unit/swe_fixture.py with a bug, built into a temp folder), each
through the environment's own turn path (`take_turn`, `to_rollout`) with a scripted agent that
applies the reference fix:
    start-up    the first tool call (`ls`): opening the copy-on-write session (the slot's server,
                the overlay over the shared snapshot) and the call itself
    tool calls  `cat` (a page), `grep`, `patch` (the reference fix), each timed alone
    live        every episode waits at a barrier with its session open and its fix written; then
                the memory of every live slot is read from its memory cgroup (v1: rss + shmem,
                the tmpfs of the upper layer, and the cgroup's whole usage) and divided by N
    end         `done`: the session reports its changes, is closed, and its grading starts
    grading     `to_rollout`'s wait for the grade: a fresh pytest job per episode over snapshot +
                changes + test patch; the pool admits `--grade-concurrency` jobs at once, so the
                figure includes the queue
Sizes run in the order given, reversed on every other round (interleaved when --rounds > 1).
Every episode must score 1 (the reference fix) and none may be infra_error; the last line
printed is one JSON object with every figure, the load average before and after included.
Needs root (copy-on-write sessions) and pytest for the sandbox's python (the default instance
copies this interpreter's when the versions agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from gapless.envs.swe.environment import SweEnvironment
from gapless.envs.swe.instances import load_instances
from gapless.envs.swe.testrun import DEFAULT_LIMITS, load_tree
from gapless.envs.swe.tools import SweTask, prompt_of
from gapless.sandbox import BwrapSandbox, SandboxLimits
from gapless.types import Completion

SLOT_UID_BASE = int(os.environ.get("GAPLESS_BENCH_UID_BASE", "330100"))
LIMITS = SandboxLimits(timeout_s=120.0, memory_mb=1024, max_processes=32, tmp_size_mb=16, max_output_bytes=8 << 20)
GRADE_LIMITS = replace(DEFAULT_LIMITS, timeout_s=600.0, memory_mb=1024, tmp_size_mb=64)


def default_instances(root: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
    from swe_instance import SANDBOX_PYTHON, build_instance

    from gapless.envs.swe.depenv import copy_installed

    return build_instance(root, copy_installed(root / "env", ["pytest"], SANDBOX_PYTHON))


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 3),
        "max": round(ordered[-1], 3),
    }


def live_memory(sandbox: BwrapSandbox) -> dict[str, int]:
    """Bytes charged to the memory cgroups of the slots that hold a session now (v1 or v2)."""
    cgroups = sandbox._pool.cgroups
    totals = {"rss_shmem": 0, "usage": 0}
    if cgroups is None:
        return totals
    for slot in list(sandbox._pool._leases):
        memory = cgroups.parents["memory"] / f"uid-{slot.uid}"
        stat = dict(line.split() for line in (memory / "memory.stat").read_text().splitlines())
        if "total_rss" in stat:  # v1: totals include the jobs' child cgroup
            totals["rss_shmem"] += int(stat["total_rss"]) + int(stat["total_shmem"])
            totals["usage"] += int((memory / "memory.usage_in_bytes").read_text())
        else:
            totals["rss_shmem"] += int(stat["anon"]) + int(stat["shmem"])
            totals["usage"] += int((memory / "memory.current").read_text())
    return totals


def run_size(env: SweEnvironment, size: int) -> dict:
    task = env.tasks("train")[0]
    script = [text for text, is_model in env.demonstration_turns(task, None) if is_model]
    patch = next(s for s in script if s.startswith("<cmd>patch"))
    turns = ["<cmd>ls</cmd>", script[0], "<cmd>grep def \\w+</cmd>", patch]
    names = ["start-up", "cat", "grep", "patch"]
    timings: dict[str, list[float]] = {name: [] for name in [*names, "end", "grading"]}
    barrier = threading.Barrier(size + 1)
    outcomes: list[tuple[float, str]] = []
    lock = threading.Lock()

    def one_episode() -> None:
        ep = env.start_episode(task, [1])
        own: dict[str, float] = {}
        try:
            for name, text in zip(names, turns):
                started = time.monotonic()
                env.take_turn(ep, Completion([1], [7], [-0.1], [0], "stop", text), lambda s: [5])
                own[name] = time.monotonic() - started
                if ep.is_done:
                    break
        finally:
            barrier.wait()  # every episode live (or failed) at once
            barrier.wait()  # the memory is read between the two
        started = time.monotonic()
        if not ep.is_done:
            env.take_turn(ep, Completion([1], [7], [-0.1], [0], "stop", "<cmd>done</cmd>"), lambda s: [5])
        own["end"] = time.monotonic() - started
        started = time.monotonic()
        rollout = env.to_rollout(ep)
        own["grading"] = time.monotonic() - started
        with lock:
            for name, seconds in own.items():
                timings[name].append(seconds)
            outcomes.append((rollout.reward, rollout.status))

    threads = [threading.Thread(target=one_episode) for _ in range(size)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    barrier.wait()
    memory = live_memory(env.sandbox)
    barrier.wait()
    for thread in threads:
        thread.join()
    statuses = sorted({status for _, status in outcomes})
    return {
        "episodes": size,
        "wall_s": round(time.monotonic() - started, 1),
        "infra_errors": sum(status == "infra_error" for _, status in outcomes),
        "solved": sum(reward == 1.0 for reward, _ in outcomes),
        "statuses": statuses,
        "latency_s": {name: percentiles(values) for name, values in timings.items()},
        "memory_per_live_episode_mib": {k: round(v / size / (1 << 20), 1) for k, v in memory.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64,256")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--instances", default=None)
    parser.add_argument("--grade-concurrency", type=int, default=16)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-swe-") as scratch:
        path = Path(args.instances) if args.instances else default_instances(Path(scratch))
        instance = load_instances(path)[0]
        task = SweTask(instance.instance_id, prompt_of(instance), instance)
        sandbox = BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE, max_concurrency=args.grade_concurrency)
        env = SweEnvironment(sandbox, {"train": [task], "eval": [task]}, LIMITS, GRADE_LIMITS,
                             max_turns=8, sessions=max(sizes))  # fmt: skip
        results = []
        try:
            for round_index in range(args.rounds):
                for size in sizes if round_index % 2 == 0 else sizes[::-1]:
                    result = run_size(env, size)
                    print(json.dumps(result), flush=True)
                    results.append(result)
        finally:
            env.close()
        snapshot_kib = sum(len(data) for data in load_tree(instance.repo_path).values()) // 1024
    print(json.dumps({"load_before": load_before, "load_after": os.getloadavg(), "cpus": os.cpu_count(),
                      "snapshot_kib": snapshot_kib, "grade_concurrency": args.grade_concurrency,
                      "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
