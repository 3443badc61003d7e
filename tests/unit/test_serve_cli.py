"""`gapless serve` as a command: a port in use is one line and exit code 2; Ctrl-C ends it cleanly."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from serve_model import tiny_policy

SRC = Path(__file__).resolve().parents[2] / "src"


def _serve(path, port):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "serve",
            "--model.path",
            str(path),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )


def test_port_in_use_and_ctrl_c(tmp_path):
    tiny_policy().save(tmp_path)
    first = _serve(tmp_path, 0)
    try:
        ready, _, _ = select.select([first.stdout], [], [], 120)
        line = first.stdout.readline() if ready else ""
        assert " at http://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        second = _serve(tmp_path, port)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and err.strip().count("\n") == 0
        assert err.startswith(f"gapless: error: port {port} on 127.0.0.1 is in use")
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
        assert first.returncode == 0 and "Traceback" not in err and "--resume" not in err, err
        assert err.strip().endswith("gapless: server stopped")
    finally:
        first.kill()
