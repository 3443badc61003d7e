"""Mechanics of one run: the bwrap command line, spawning it, reading it, killing it.

`execute` spawns bwrap (as the slot uid when a uid is given), reads stdout, stderr, the report
pipe and the start-marker pipe concurrently under their caps, enforces the wall deadline and
returns what it saw. It never raises for anything the program does, and turns a failure to
spawn into an `Observation` with `has_started=False`.

Who waits for whom (one run, all in the caller's thread):

    caller --Popen--> bwrap monitor --clone--> boot.py as pid 1 of the run's pid namespace
      |                                           `--fork--> program --> its children ...
      |-- pump(pipes) until EOF or deadline
      |-- wait(monitor) until deadline; the monitor exits once it has reaped pid 1, and pid 1
      |   exits only after the kernel has killed and reaped the rest of the namespace
      `-- at the deadline: SIGKILL pid 1 (the kernel then kills the whole namespace) and the
          slot uid's processes, keeping the monitor alive to reap pid 1; then reap the monitor

Killing the monitor first would orphan pid 1, whose zombie then waits for the host's pid 1
(measured: about a second here) while it counts against the slot's RLIMIT_NPROC.

NOT guaranteed: the deadline is checked by this thread, so a run ends within `timeout_s` plus
the kill grace (normally a few milliseconds), not exactly at it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from gapless.sandbox import procs
from gapless.sandbox.limits import MIB, SandboxLimits
from gapless.sandbox.result import Observation
from gapless.sandbox.streams import CappedSink, pump

JOB_DIR_INSIDE = "/work/job"
REPORT_CAP_BYTES = 1 << 20
KILL_GRACE_S = 2.0
BOOT_SOURCE = Path(__file__).with_name("boot.py").read_text(encoding="utf-8")


def _root_link_args() -> list[str]:
    """Recreate /bin, /lib, /lib64, /sbin as the host has them: symlinks into /usr on a
    merged-/usr system (Debian 12), read-only binds otherwise."""
    args: list[str] = []
    for name in ("bin", "lib", "lib64", "sbin"):
        path = Path("/", name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


ROOT_LINK_ARGS = _root_link_args()


def bwrap_argv(bwrap: str, job_dir: Path, limits: SandboxLimits) -> list[str]:
    """bwrap and its options, up to and including `--`; the reasons are in bwrap.py."""
    tmpfs_bytes = str(limits.tmp_size_mb * MIB)
    return [
        bwrap,
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--die-with-parent", "--as-pid-1", "--new-session", "--cap-drop", "ALL",
        "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp",
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr", *ROOT_LINK_ARGS,
        "--proc", "/proc", "--dev", "/dev",
        "--size", tmpfs_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        "--size", tmpfs_bytes, "--tmpfs", "/tmp",
        "--ro-bind", str(job_dir), JOB_DIR_INSIDE,
        "--remount-ro", "/",
        "--chdir", "/tmp",
        "--",
    ]  # fmt: skip


@dataclass(frozen=True)
class RunOutput:
    seen: Observation
    stdout: bytes
    report: bytes
    wall_s: float


def execute(
    sandbox_args: list[str],
    python: str,
    program_args: Sequence[str],
    limits: SandboxLimits,
    launch_uid: int | None,
) -> RunOutput:
    """Run `sandbox_args + [python, -I, -B, -c, bootstrap, spec] + program_args`, where
    `program_args` is the program's path inside the sandbox, then its arguments.

    `launch_uid`: host uid and gid to run bwrap as (needs root), or None for the caller's own.
    """
    names = ("stdout", "stderr", "report", "started")
    pipes = {name: os.pipe() for name in names}
    caps = (limits.max_output_bytes, limits.max_output_bytes, REPORT_CAP_BYTES, 1)
    sinks = {name: CappedSink(cap) for name, cap in zip(names, caps)}
    spec = {
        "rlimits": limits.rlimits(),
        "report_fd": pipes["report"][1],
        "started_fd": pipes["started"][1],
    }
    argv = [*sandbox_args, python, "-I", "-B", "-c", BOOT_SOURCE, json.dumps(spec), *program_args]
    reading = {read_fd: sinks[name] for name, (read_fd, _) in pipes.items()}
    start_s = time.monotonic()
    try:
        proc = _spawn(argv, pipes, launch_uid)
    except (OSError, subprocess.SubprocessError) as error:
        for read_fd in reading:
            os.close(read_fd)
        message = f"could not start bwrap: {type(error).__name__}: {error}"
        seen = Observation(has_started=False, returncode=None, is_deadline_hit=False,
                           stderr=message.encode(), is_truncated=False)  # fmt: skip
        return RunOutput(seen, b"", b"", time.monotonic() - start_s)
    finally:
        for _, write_fd in pipes.values():
            os.close(write_fd)
    try:
        returncode = _collect(proc, reading, start_s + limits.timeout_s)
        if returncode is None:
            _kill_run(proc, launch_uid)
            pump(reading, time.monotonic() + KILL_GRACE_S)
        wall_s = time.monotonic() - start_s
    finally:
        for read_fd in reading:
            os.close(read_fd)
        if proc.poll() is None:  # only reached if this thread was interrupted
            _kill_run(proc, launch_uid)
    seen = Observation(
        has_started=bytes(sinks["started"].data) == b"1",
        returncode=returncode,
        is_deadline_hit=returncode is None,
        stderr=bytes(sinks["stderr"].data),
        is_truncated=any(sinks[name].is_truncated for name in ("stdout", "stderr", "report")),
    )
    return RunOutput(seen, bytes(sinks["stdout"].data), bytes(sinks["report"].data), wall_s)


def _spawn(
    argv: list[str], pipes: dict[str, tuple[int, int]], launch_uid: int | None
) -> subprocess.Popen[bytes]:
    identity: dict[str, object] = {}
    if launch_uid is not None:  # never run bwrap as root: it would keep root's power
        identity = {"user": launch_uid, "group": launch_uid, "extra_groups": []}
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=pipes["stdout"][1],
        stderr=pipes["stderr"][1],
        pass_fds=(pipes["report"][1], pipes["started"][1]),
        close_fds=True,
        cwd="/",
        env={},
        start_new_session=True,  # its own process group, away from our terminal's signals
        **identity,  # type: ignore[arg-type]
    )


def _collect(proc: subprocess.Popen[bytes], reading: dict[int, CappedSink], deadline: float
             ) -> int | None:  # fmt: skip
    """Read until EOF, then reap; returns bwrap's exit code, or None at the deadline."""
    if not pump(reading, deadline):
        return None
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return None


def _kill_run(proc: subprocess.Popen[bytes], launch_uid: int | None) -> None:
    """Kill the run's namespace, then reap the monitor (see the module docstring for order)."""
    procs.kill_pids(procs.child_pids(proc.pid))
    if launch_uid is not None:
        procs.kill_uid(launch_uid, spare_pid=proc.pid)
    try:
        proc.wait(timeout=KILL_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # left to the caller's slot check, which quarantines
        pass
