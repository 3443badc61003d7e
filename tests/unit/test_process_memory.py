"""The run's peak RSS counts a child process's own high-water mark, not only the trainer's."""

import subprocess
import sys

from gapless.orchestrate.process_memory import peak_rss_metrics

HOLD_200MB = "b = bytearray(200 << 20); import sys; print('ready', flush=True); sys.stdin.read()"


def test_peak_rss_sums_live_children():
    before = peak_rss_metrics()
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_200MB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        during = peak_rss_metrics()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert during["perf/peak_rss_mb"] - during["perf/trainer_peak_rss_mb"] >= 200
    assert abs(during["perf/trainer_peak_rss_mb"] - before["perf/trainer_peak_rss_mb"]) < 50  # the child's, not ours
    after = peak_rss_metrics()  # an exited child is no longer counted
    assert after["perf/peak_rss_mb"] - after["perf/trainer_peak_rss_mb"] < 200
