"""Sandbox speed: the fastest path against a cold sandbox per job and against a bare subprocess.

    python bench/sandbox.py [--rounds 6] [--batch 96] [--concurrency 4 x cpus] [--baseline REF]

Three ways to run the trivial program `print(1)`, measured side by side in one run:
- warm: `BwrapSandbox(warm=True)`, each job forked from a pre-started server in its slot;
- cold: `BwrapSandbox(warm=False)`, a new bwrap and a fresh interpreter per job (same code
  inside, same guarantees);
- subprocess: `subprocess.run([python3, "-c", ...])`, no isolation at all (what most RL code
  uses, and the floor of any design that starts an interpreter per job).
Each round runs a batch of every variant with `--concurrency` threads, in a rotating order, so
that other load on the machine hits all three alike. Throughput is jobs / wall time of the
batches; latency is per job, queueing excluded. CPU per job is everything the variant burnt:
this process, its reaped children (bwrap, python) and, for the warm path, the slots' cgroups
(the servers are not reaped until the end). On a shared machine, throughput depends on what else
runs; CPU per job does not, and `capacity_per_s` = cpus / CPU per job is the throughput the
variant would reach on an otherwise idle machine. A second table splits a cold run into its
parts (sequential medians): bwrap alone, bwrap + an interpreter, the interpreter alone.

`--baseline REF` (a git commit, e.g. the one before a sandbox change) adds, in the same run and
the same rotation, the warm path of that commit's code and, for the code environment, one
judged job of an io task (envs/code/environment.py: judge + candidate processes) against that commit's way
of scoring the same completion; `*_over_baseline` ratios compare them (the commit's
`src/gapless` is extracted under bench/out/ as the package `gapless_baseline`).

Needs root (slot uids, cgroups) and bwrap for the sandbox variants. The last line printed is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gapless.sandbox import BwrapSandbox, Status  # noqa: E402
from gapless.sandbox.launch import ROOT_LINK_ARGS  # noqa: E402

PYTHON = "/usr/bin/python3"
PROGRAM = "print(1)\n"
UID_BASE = 240000  # away from services and tests
WARM_UID_BASES = {
    "warm": UID_BASE,
    "warm_baseline": UID_BASE + 2000,
    "judged": UID_BASE + 3000,
    "judged_baseline": UID_BASE + 4000,
}  # slot cgroups whose CPU a variant owns
JUDGED_TEXT = "sorted(x)[::-1]"  # an io task's completion: reverse-sorted list


def timed(run: Callable[[], bool]) -> tuple[float, bool]:
    start = time.perf_counter()
    ok = run()
    return time.perf_counter() - start, ok


def batch(run: Callable[[], bool], size: int, concurrency: int) -> tuple[float, list[float], int]:
    """(wall seconds, per-job latencies, failures) of `size` jobs on `concurrency` threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: timed(run), range(size)))
    return time.perf_counter() - start, [r[0] for r in results], sum(not r[1] for r in results)


def slot_cpu_s(uid_base: int) -> float:
    """CPU seconds of every slot cgroup of the pool with this uid base (cgroup v1 cpuacct)."""
    total = 0
    for usage in Path("/sys/fs/cgroup").glob("cpuacct*/**/gapless-sandbox/uid-*/cpuacct.usage"):
        if uid_base <= int(usage.parent.name[4:]) < uid_base + 1000:
            total += int(usage.read_text())
    return total / 1e9


def cpu_s(warm_uid_base: int | None) -> float:
    """This process's CPU, its reaped children's, and the warm slots' (see module docstring)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + children.ru_utime + children.ru_stime
    return total + (slot_cpu_s(warm_uid_base) if warm_uid_base is not None else 0.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def breakdown(samples: int) -> dict[str, float]:
    """Sequential medians (ms) of a cold run's parts."""
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
             *ROOT_LINK_ARGS, "--proc", "/proc", "--dev", "/dev"]  # fmt: skip
    parts = {
        "bwrap_true_ms": [*bwrap, "/bin/true"],
        "bwrap_python_ms": [*bwrap, PYTHON, "-c", "pass"],
        "python_ms": [PYTHON, "-c", "pass"],
        "python_isolated_boot_imports_ms": [PYTHON, "-I", "-B", "-c", "import ctypes, marshal, _socket, resource"],
    }
    medians = {}
    for name, argv in parts.items():
        times = [timed(lambda: subprocess.run(argv, check=True) is not None)[0] for _ in range(samples)]
        medians[name] = round(statistics.median(times) * 1000, 2)
    return medians


def baseline_variants(ref: str, concurrency: int, pools: dict[str, object]) -> dict[str, Callable[[], bool]]:
    """warm_baseline, judged and judged_baseline (see the module docstring)."""
    from gapless.envs.code.environment import CodeEnvironment
    from gapless.envs.code.problems import CodeProblem
    from gapless.sandbox import SandboxLimits

    base_sandbox, base_code = load_baseline(ref)
    problem = CodeProblem(uid="bench", level=1, prompt="def f(x):\n    return ", solution=JUDGED_TEXT,
                          overfit_solution=JUDGED_TEXT, entry_point="f",
                          test_inputs=("[[3, 1, 2]]", "[[5]]", "[[]]"), test_outputs=("[3, 2, 1]", "[5]", "[]"))  # fmt: skip
    limits, base_limits = SandboxLimits(timeout_s=5.0), base_sandbox.SandboxLimits(timeout_s=5.0)
    base_warm = base_sandbox.BwrapSandbox(slot_uid_base=WARM_UID_BASES["warm_baseline"], warm=True,
                                          max_concurrency=concurrency)  # fmt: skip
    judged = CodeEnvironment(BwrapSandbox(slot_uid_base=WARM_UID_BASES["judged"], max_concurrency=concurrency),
                             limits, concurrency=1)  # fmt: skip
    base_judged = base_code.CodeEnvironment(
        base_sandbox.BwrapSandbox(slot_uid_base=WARM_UID_BASES["judged_baseline"], max_concurrency=concurrency),
        base_limits,
        concurrency=1,
    )
    pools.update(warm_baseline=base_warm, judged=judged, judged_baseline=base_judged)
    return {
        "warm_baseline": lambda: base_warm.run_python({"m.py": PROGRAM}, "m.py").status.value == "ok",
        "judged": lambda: judged.score_text(problem, JUDGED_TEXT)[1] == "ok",
        "judged_baseline": lambda: base_judged.score_text(problem, JUDGED_TEXT)[1] == "ok",
    }


def load_baseline(ref: str):
    """The `gapless` package of commit `ref`, importable as `gapless_baseline`."""
    import importlib
    import io
    import re
    import tarfile

    root = Path(__file__).resolve().parents[1]
    target = root / "bench" / "out" / f"baseline-{ref}"
    if not (target / "gapless_baseline").is_dir():
        archive = subprocess.run(["git", "-C", str(root), "archive", ref, "src/gapless"], check=True,
                                 capture_output=True).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                if not member.isfile():
                    continue
                path = target / "gapless_baseline" / Path(member.name).relative_to("src/gapless")
                path.parent.mkdir(parents=True, exist_ok=True)
                text = tar.extractfile(member).read()
                if path.suffix == ".py":
                    text = re.sub(rb"\bgapless\.", b"gapless_baseline.", text)
                path.write_bytes(text)
    sys.path.insert(0, str(target))
    return importlib.import_module("gapless_baseline.sandbox"), importlib.import_module("gapless_baseline.envs.code")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4 * (os.cpu_count() or 1))
    parser.add_argument("--breakdown-samples", type=int, default=20)
    parser.add_argument("--baseline", default=None, help="git commit whose warm path runs beside")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if os.geteuid() != 0:
        print("bench/sandbox.py: run as root (slot uids and cgroups need it)", file=sys.stderr)
        return 2
    warm = BwrapSandbox(slot_uid_base=UID_BASE, warm=True, max_concurrency=args.concurrency)
    cold = BwrapSandbox(slot_uid_base=UID_BASE + 1000, warm=False, max_concurrency=args.concurrency)
    pools: dict[str, object] = {}  # the baseline's and the code environments' (closed below)
    try:
        variants: dict[str, Callable[[], bool]] = {
            "warm": lambda: warm.run_python({"m.py": PROGRAM}, "m.py").status is Status.OK,
            "cold": lambda: cold.run_python({"m.py": PROGRAM}, "m.py").status is Status.OK,
            "subprocess": lambda: (
                subprocess.run([PYTHON, "-c", PROGRAM], capture_output=True, timeout=30).stdout == b"1\n"
            ),
        }
        if args.baseline:
            variants.update(baseline_variants(args.baseline, args.concurrency, pools))
        for run in variants.values():  # warm-up: slots prepared, servers started, caches hot
            batch(run, args.concurrency * 2, args.concurrency)
        walls = {name: 0.0 for name in variants}
        cpus = {name: 0.0 for name in variants}
        latencies: dict[str, list[float]] = {name: [] for name in variants}
        failures = {name: 0 for name in variants}
        names = list(variants)
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                warm_base = WARM_UID_BASES.get(name)
                cpu_before = cpu_s(warm_base)
                wall, times, failed = batch(variants[name], args.batch, args.concurrency)
                cpus[name] += cpu_s(warm_base) - cpu_before
                walls[name] += wall
                latencies[name] += times
                failures[name] += failed
        parts = breakdown(args.breakdown_samples)
        sandbox_metrics = {"warm": warm.metrics(), "cold": cold.metrics()}
        sandbox_metrics.update({name: pool.metrics() for name, pool in pools.items()})  # type: ignore[attr-defined]
    finally:
        warm.close()
        cold.close()
        for pool in pools.values():
            pool.close()  # type: ignore[attr-defined]
    figures: dict[str, object] = {"rounds": args.rounds, "batch": args.batch,
                                  "concurrency": args.concurrency, "cpus": os.cpu_count()}  # fmt: skip
    print(f"{'variant':<12}{'exec/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'cpu ms/job':>12}"
          f"{'capacity/s':>12}{'failures':>10}")  # fmt: skip
    for name in names:
        count = len(latencies[name])
        rate = count / walls[name]
        p50, p99 = (percentile(latencies[name], q) * 1000 for q in (50, 99))
        cpu_ms = cpus[name] / count * 1000
        capacity = (os.cpu_count() or 1) * 1000 / cpu_ms
        figures[name] = {"executions_per_s": round(rate, 1), "p50_ms": round(p50, 2),
                         "p99_ms": round(p99, 2), "cpu_ms_per_job": round(cpu_ms, 2),
                         "capacity_per_s": round(capacity, 1), "failures": failures[name]}  # fmt: skip
        print(f"{name:<12}{rate:>9.1f}{p50:>9.2f}{p99:>9.2f}{cpu_ms:>12.2f}{capacity:>12.1f}"
              f"{failures[name]:>10}")  # fmt: skip
    for key in ("executions_per_s", "capacity_per_s"):
        rate = {name: figures[name][key] for name in names}  # type: ignore[index]
        figures[f"warm_over_cold_{key}"] = round(rate["warm"] / rate["cold"], 2)
        figures[f"warm_over_subprocess_{key}"] = round(rate["warm"] / rate["subprocess"], 2)
    for name in ("warm", "judged"):
        if f"{name}_baseline" in figures:
            for key in ("executions_per_s", "capacity_per_s"):
                figures[f"{name}_over_baseline_{key}"] = round(figures[name][key] / figures[f"{name}_baseline"][key], 3)  # type: ignore[index]
            figures[f"{name}_cpu_ms_per_job_over_baseline"] = round(
                figures[name]["cpu_ms_per_job"] / figures[f"{name}_baseline"]["cpu_ms_per_job"], 3
            )  # type: ignore[index]
    figures["cold_parts_ms"] = parts
    figures["infra_errors"] = {k: v["sandbox/infra_errors_total"] for k, v in sandbox_metrics.items()}
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(f"warm / cold: {figures['warm_over_cold_executions_per_s']}x measured here, "
          f"{figures['warm_over_cold_capacity_per_s']}x in CPU per job; "
          f"load average {figures['load_average_1m']}; cold parts (ms): {parts}")  # fmt: skip
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
