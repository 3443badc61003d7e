"""1,024 concurrent submissions through the event-loop API: all complete, none is an
infra_error, nothing deadlocks, no job runs on the loop's thread, the host is clean after. Queue
and run latency percentiles and the worst event-loop lag are printed (pytest -s) for the record:
the lag is a measurement of the machine as much as of the code, so it is not asserted here."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.sandbox import BwrapSandbox, SandboxResult, Status

pytestmark = needs_bwrap
SUBMISSIONS = 1024
DEADLOCK_GUARD_S = 240.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def submit_all(box: BwrapSandbox) -> tuple[list[SandboxResult], float, float, set[int]]:
    loop = asyncio.get_running_loop()
    worst_lag = 0.0
    run_threads: set[int] = set()
    pool_run = box._pool.run

    def recording_run(*args, **kwargs):  # the real run, noting which thread it ran on
        run_threads.add(threading.get_ident())
        return pool_run(*args, **kwargs)

    box._pool.run = recording_run

    async def ticker() -> None:
        nonlocal worst_lag
        while True:
            start = loop.time()
            await asyncio.sleep(0.01)
            worst_lag = max(worst_lag, loop.time() - start - 0.01)

    tick = asyncio.create_task(ticker())
    start = time.monotonic()
    jobs = [box.arun_python({"m.py": f"print({i})"}, "m.py") for i in range(SUBMISSIONS)]
    results = await asyncio.wait_for(asyncio.gather(*jobs), DEADLOCK_GUARD_S)
    wall_s = time.monotonic() - start
    tick.cancel()
    return results, wall_s, worst_lag, run_threads


def run_burst(warm: bool) -> None:
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, warm=warm) as box:
        loop_thread = threading.get_ident()  # asyncio.run runs the loop on this thread
        results, wall_s, worst_lag, run_threads = asyncio.run(submit_all(box))
        assert [r.status for r in results] == [Status.OK] * SUBMISSIONS
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(SUBMISSIONS)]
        metrics = box.metrics()
        assert metrics["sandbox/infra_errors_total"] == 0 and metrics["sandbox/infra_retries_total"] == 0
        assert box.leftovers() == []
        queue = [r.queue_s for r in results]
        run = [r.wall_s for r in results]
        print(
            f"\n{box.path}: {SUBMISSIONS} submissions in {wall_s:.1f}s "
            f"({SUBMISSIONS / wall_s:.0f}/s, admission {box.max_concurrency}); "
            f"queue p50/p99 {percentile(queue, 50):.2f}/{percentile(queue, 99):.2f}s; "
            f"run p50/p99 {percentile(run, 50) * 1000:.0f}/{percentile(run, 99) * 1000:.0f}ms; "
            f"worst event-loop lag {worst_lag * 1000:.0f}ms"
        )
        assert run_threads and loop_thread not in run_threads  # spawning never ran on the loop


def test_1024_concurrent_submissions_warm(clean_host):
    run_burst(warm=True)


@pytest.mark.slow
def test_1024_concurrent_submissions_cold(clean_host):
    run_burst(warm=False)
