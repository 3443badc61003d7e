"""Crash-test harness: run `gapless train` under a supervisor that adopts every orphan.

The supervisor is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so any process the run
leaves behind -- an actor that outlived a SIGKILLed trainer, a sandbox server -- becomes its
child instead of init's. After the run exits it waits `linger_s` for them to go, reports the
survivors and kills them, so a failing case never leaks processes into the next.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).parents[2] / "src"
SUPERVISOR = r"""
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
linger_s, stderr_path = float(sys.argv[1]), sys.argv[2]
with open(stderr_path, "w") as err:  # a file, not a pipe: a survivor holding it open cannot block us
    child = subprocess.Popen(sys.argv[3:], stdout=subprocess.DEVNULL, stderr=err)
    child.wait()
ended = time.monotonic()

def descendants():
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.append((int(entry), cmd[:200]))
    return found

deadline = ended + linger_s
while descendants() and time.monotonic() < deadline:
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        pass
    time.sleep(0.1)
survivors = descendants()
for pid, _ in survivors:
    os.kill(pid, signal.SIGKILL)
print(json.dumps({"rc": child.returncode, "ended": ended, "stderr": open(stderr_path).read(), "survivors": survivors}))
"""


@dataclass
class Outcome:
    rc: int
    ended: float  # CLOCK_MONOTONIC when the run exited
    stderr: str
    survivors: list  # [pid, cmdline] of processes still alive linger_s after the exit
    fault_log: str = ""  # what the fault points wrote to GAPLESS_FAULT_LOG (actors on Ray placement included)

    @property
    def fault_time(self) -> float | None:
        match = re.search(r"gapless fault: \w+ \w+ at \w+ #\d+ t=([\d.]+)", self.fault_log + self.stderr)
        return float(match.group(1)) if match else None


def train(
    args: list[str], stderr_path: Path, fault: str | None = None, linger_s: float = 5.0, timeout_s: float = 300
) -> Outcome:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    env.pop("GAPLESS_FAULT", None)
    fault_log = Path(f"{stderr_path}.faults")
    fault_log.unlink(missing_ok=True)
    if fault:
        env["GAPLESS_FAULT"], env["GAPLESS_FAULT_LOG"] = fault, str(fault_log)
    command = [
        sys.executable,
        "-c",
        SUPERVISOR,
        str(linger_s),
        str(stderr_path),
        sys.executable,
        "-m",
        "gapless.cli",
        "train",
        *args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=True)
    outcome = Outcome(**json.loads(done.stdout.strip().splitlines()[-1]))
    outcome.fault_log = fault_log.read_text() if fault_log.exists() else ""
    return outcome
