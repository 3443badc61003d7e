"""A `gapless` server command as a child process of a test, ready once it prints its URL."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def start_server(argv: list[str], ready: str, timeout_s: float = 600) -> tuple[subprocess.Popen, str, list[str]]:
    """Run `python -m gapless.cli ARGV` until a stdout line contains `ready` and a URL; returns the
    process, the URL and the output lines so far (drained by a thread afterwards: vLLM logs a lot)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gapless.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], 5)
        if not readable:
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if ready in line and "http://" in line:
            url = "http://" + line.split("http://", 1)[1].split()[0]
            threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
            return proc, url, lines
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines[-40:]))
