"""Host side of one slot's server: start it, run jobs on it one at a time, stop it.

A warm worker keeps its server between jobs (each job is forked from it, boot.py); a cold one
starts a server for a single job and stops it after. Both run the very same code inside.

Who waits for whom (one job, all in the calling thread):

    caller --send request + fds--> server --fork--> init --fork--> program
      |-- pump(stdout, stderr, report, status) until EOF or the deadline
      |-- at the deadline: SIGKILL every process of the slot that is not the server or its bwrap
      |   monitor (cgroup.procs, or the server's descendants); the kernel also kills the whole
      |   pid namespace of the job once its init is dead
      `-- return the result; before the slot's next job (`settle`): await the server's `done`
          (it has reaped init, whose exit the kernel completes only once every process of the
          job's pid namespace is gone), then check that the slot holds nothing but the server

Guaranteed: every wait is bounded by the job's deadline plus fixed graces; `run` raises only
`SlotFailure`, and only when the job cannot have started (the caller turns it into infra_error);
`observe` reads "not started" only from the status pipe's first line, which the program cannot
write (result.py has the attribution rule).
NOT guaranteed: the clean check cannot see a process that escaped both the cgroup and the pid
namespace; none can without a kernel bug.
"""

from __future__ import annotations

import json
import marshal
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gapless.sandbox import launch, procs
from gapless.sandbox.cgroups import CgroupCounters, SlotCgroup
from gapless.sandbox.cow import SessionBase
from gapless.sandbox.job import Job
from gapless.sandbox.limits import MIB, SandboxLimits
from gapless.sandbox.result import Observation
from gapless.sandbox.seccomp import filter_program
from gapless.sandbox.streams import CappedSink, pump, ready

PREIMPORT = (
    "json", "re", "math", "collections", "itertools", "functools", "heapq", "bisect", "string",
    "random", "typing", "dataclasses", "copy", "operator", "fractions", "decimal", "statistics",
)  # fmt: skip
CGROUP_SLOT_TASKS = 3  # tasks in the slot cgroup besides the program's: server, forker, init
NPROC_SLOT_TASKS = 4  # tasks of the slot uid in its user namespace: also bwrap's pid 1
SYSCALL_FILTER = filter_program()  # seccomp.py: the same bytes for every server of this host
MAX_JOBS_PER_SERVER = 1000  # then a fresh server: fresh hash seed, no slow memory creep
REPORT_CAP_BYTES = 1 << 20
GRACE_S = 2.0
STARTUP_TIMEOUT_S = 15.0  # from sending a job (cold: spawning bwrap) to the program's start line
STOP_WAIT_S = 0.5  # for a server told to exit (EOF on its control socket), before killing it
FS_SLACK_BYTES = 64 << 10  # /tmp with less than this free at the end counts as full


class SlotFailure(Exception):
    """The slot could not run the job; its message is the infra_error's explanation."""


@dataclass
class RunOutput:
    seen: Observation
    stdout: bytes
    report: bytes
    wall_s: float


@dataclass
class JobPipes:
    """Host ends of one job's pipes (read ends; stdin: the write end, sessions only), and the
    slot's cgroup counters when it was sent."""

    stdout: int
    stderr: int
    report: int
    status: int
    stdin: int | None
    before: CgroupCounters | None


class SlotWorker:
    def __init__(self, *, uid: int | None, cgroup: SlotCgroup | None, python: str,
                 bwrap: str | None, warm: bool, session_limits: SandboxLimits | None = None,
                 session_base: SessionBase | None = None) -> None:  # fmt: skip
        self.uid = uid
        self.cgroup = cgroup
        self.python = python
        self.bwrap = bwrap  # None: reduced mode, no namespaces
        self.warm = warm
        self.session_limits = session_limits
        self.session_base = session_base  # a copy-on-write session's tree (cow.py)
        self._process = None
        self._errors = None
        self._control: socket.socket | None = None
        self._infra: frozenset[int] = frozenset()
        self._jobs = 0
        self._seq = 0
        self._cgroup_limits: tuple[int, int] | None = None
        self.starts = 0  # servers started so far
        self._pending = False  # a job was sent and its `done` not yet read
        self._scratch: list[Path] = []  # reduced mode: host directories of the current job

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def needs_restart(self) -> bool:
        return not self.is_running or self._jobs >= MAX_JOBS_PER_SERVER

    def start(self, timeout_s: float) -> None:
        """Start the server and wait for it to be ready; SlotFailure says why it is not."""
        host_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec: dict[str, object] = {
            "isolate": self.bwrap is not None,
            "max_jobs": MAX_JOBS_PER_SERVER if self.warm else 1,
            "preimport": list(PREIMPORT) if self.warm and self.bwrap else [],
            "filter": SYSCALL_FILTER,
        }
        cow_caps = None
        if self.session_limits is not None:
            spec["session"] = _tmpfs_caps(self.session_limits)
            if self.session_base is not None:  # /work/session is the helper's overlay, not a tmpfs
                cow_caps, spec["session"] = spec["session"], {"cow": True}
        env = {"PATH": "/usr/bin:/bin"} if self.bwrap is None else None
        try:
            self._process, self._errors = launch.spawn_server(
                spec, child_end.fileno(), self.python, self.bwrap, self.uid, env, self.session_base, cow_caps
            )
        except (OSError, ValueError) as error:
            host_end.close()
            raise SlotFailure(f"could not start the sandbox: {type(error).__name__}: {error}")
        finally:
            child_end.close()
        self._control = host_end
        self._jobs = 0
        self.starts += 1
        message = self._receive(time.monotonic() + timeout_s)
        if message is None or "ready" not in message:
            detail = launch.read_tail(self._errors) or "no message"
            self.stop()
            raise SlotFailure(f"sandbox did not start within {timeout_s:.1f}s: {detail}")
        if self.bwrap:  # bwrap monitor -> bwrap's pid 1 (a waiter) -> the server
            waiters = procs.child_pids(self._process.pid)
            servers = [pid for waiter in waiters for pid in procs.child_pids(waiter)]
        else:
            waiters, servers = [], [self._process.pid]
        forkers = [pid for server in servers for pid in procs.child_pids(server)]  # boot.py
        self._infra = frozenset({self._process.pid, *waiters, *servers, *forkers})
        try:
            if self.cgroup is not None:
                if self.cgroup.ensure():
                    self._cgroup_limits = None  # made afresh: its limits are the defaults
                for pid in servers:  # nothing forks before the first job: no race
                    self.cgroup.attach(pid)
                for pid in forkers:  # the jobs' memory cgroup, out of the server's
                    self.cgroup.attach_forker(pid)
            if self.uid is not None and (self.cgroup is None or self.cgroup.job_memory is None):
                for pid in forkers:  # no jobs' memory cgroup to keep the server out of reach
                    launch.set_oom_floor(pid)
        except OSError as error:
            self.stop()
            raise SlotFailure(f"could not confine the sandbox (cgroup, OOM floor): {error}")

    def run(self, job: Job, limits: SandboxLimits, start_s: float) -> RunOutput:
        """Run `job` to its end or to `start_s + limits.timeout_s`, whichever comes first.
        Returns once its pipes are closed; `settle` later confirms that nothing of it is left
        (off the caller's critical path: the pool settles a slot before its next job)."""
        pipes = self.submit(job, limits)
        sinks = {
            pipes.stdout: CappedSink(limits.max_output_bytes),
            pipes.stderr: CappedSink(limits.max_output_bytes),
            pipes.report: CappedSink(REPORT_CAP_BYTES),
            pipes.status: CappedSink(1 << 16),
        }
        named = dict(zip(("stdout", "stderr", "report", "status"), sinks.values()))
        reading = dict(sinks)
        try:  # the program's clock starts at its start line (boot.py): start-up is not its time
            is_complete = pump(reading, start_s + STARTUP_TIMEOUT_S, anchor=(pipes.status, limits.timeout_s))
            if not is_complete:
                self.kill_job()
                pump(reading, time.monotonic() + GRACE_S)
        finally:
            for fd in reading:
                os.close(fd)
        wall_s = time.monotonic() - start_s
        seen = self.observe(pipes, named, is_deadline_hit=not is_complete, limits=limits,
                            is_judged=job.judged is not None)  # fmt: skip
        if self.cgroup is not None:  # before the caller sees the result (cgroups.py)
            self.cgroup.drop_page_cache()
        return RunOutput(seen, bytes(named["stdout"].data), bytes(named["report"].data), wall_s)

    def settle(self) -> bool:
        """Wait for the server's answer to the last job, then check that the slot holds
        nothing but the server. False: the worker is stopped (it must be restarted)."""
        if self._pending:
            self._pending = False
            if self.await_done() is None:
                return False
            _remove(self._scratch)
            if self.cgroup is not None:  # what the job's processes still mapped at its end
                self.cgroup.drop_page_cache()
        return self.is_running and self.is_clean()

    def submit(self, job: Job, limits: SandboxLimits, *, with_stdin: bool = False
               ) -> JobPipes:  # fmt: skip
        """Send `job` to the server; returns the host's ends of its pipes."""
        if self._control is None:
            raise SlotFailure("the slot's server is not running")
        self._apply_cgroup_limits(limits)
        before = self.cgroup.counters() if self.cgroup is not None else None
        ends = [os.pipe() for _ in range(4)]  # stdout, stderr, report, status
        stdin_read, stdin_write = os.pipe() if with_stdin else (os.open(os.devnull, os.O_RDONLY), None)
        scratch: list[Path] = []
        memfd = -1
        try:
            memfd = job.pack()
            request = self._request(job, limits, scratch)
            self._seq += 1
            request["seq"] = self._seq
            fds = [stdin_read, *(write for _, write in ends), memfd]
            socket.send_fds(self._control, [marshal.dumps(request)], fds)
        except BaseException as error:
            for read, _ in ends:
                os.close(read)
            if stdin_write is not None:
                os.close(stdin_write)
            _remove(scratch)
            if isinstance(error, OSError):
                raise SlotFailure(f"could not send the job to the slot: {error}") from error
            raise
        finally:
            for fd in (stdin_read, *(write for _, write in ends), memfd):
                if fd >= 0:
                    os.close(fd)
        self._jobs += 1
        self._pending = True
        self._scratch = scratch
        reads = [read for read, _ in ends]
        return JobPipes(*reads, stdin=stdin_write, before=before)

    def kill_job(self) -> None:
        """SIGKILL every process of the current job (the server and its monitor survive)."""
        if self.cgroup is not None:
            self.cgroup.kill_all(keep=self._infra)
            return
        for _ in range(20):
            targets = [pid for pid in self._job_processes()]
            if not targets:
                return
            procs.kill_pids(targets)
            time.sleep(procs.POLL_INTERVAL_S)

    def await_done(self) -> int | None:
        """The server's answer for the current job (init's wait status), or None if the
        server is gone or mute, in which case it is stopped and must be restarted."""
        message = self._receive(time.monotonic() + GRACE_S)
        if message is None or message.get("done") != self._seq or "error" in message:
            self.stop()
            return None
        if message.get("restart"):  # its forker was killed (boot.py): answered, then gone
            self.stop()
        return message.get("wait_status")

    def is_clean(self) -> bool:
        """No process of the slot besides the server (none at all once stopped)."""
        if self.cgroup is not None:
            return self.cgroup.pids() <= self._infra
        return not self._job_processes()

    def observe(self, pipes: JobPipes, sinks: dict[str, CappedSink], *, is_deadline_hit: bool,
                limits: SandboxLimits, is_judged: bool = False) -> Observation:  # fmt: skip
        lines = _status_lines(bytes(sinks["status"].data))
        # Only the first line can say "not started": it is written before the program's first
        # line runs. An "infra" line after it is init failing while the program ran, which the
        # program may have caused (its limits, its memory): no final line, so `classify` says KILLED.
        start = lines[0] if lines else {}
        final = next((line for line in lines[1:] if "exit" in line), None)
        infra = start.get("infra")
        after = self.cgroup.counters() if self.cgroup is not None else None
        before = pipes.before
        cpu_s = final.get("cpu_s") if final else None
        if before is not None and after is not None and after.cpu_ns is not None:
            cpu_s = (after.cpu_ns - (before.cpu_ns or 0)) / 1e9
        stderr = bytes(sinks["stderr"].data)
        if infra is not None or not start:
            stderr = (infra or "").encode() or stderr
        return Observation(
            has_started=start.get("started") is True,
            returncode=final["exit"] if final else None,
            is_deadline_hit=is_deadline_hit,
            stderr=stderr,
            is_truncated=any(sinks[name].is_truncated for name in ("stdout", "stderr", "report")),
            compile_error=start.get("compile_error"),
            full_filesystem=final.get("full") if final else None,
            oom_kills=after.oom_kills - before.oom_kills if before and after else None,
            pids_max_hits=after.pids_max_hits - before.pids_max_hits if before and after else None,
            cpu_s=cpu_s,
            cpu_limit_s=limits.cpu_limit_s,
            is_judged=is_judged,
            candidate_returncode=final.get("candidate_exit") if final else None,
            candidate_cpu_s=final.get("candidate_cpu_s") if final else None,
        )

    def stop(self) -> bool:
        """Stop the server and everything of the slot; True if nothing is left."""
        if self._control is not None:
            self._control.close()  # the server reads EOF and exits
            self._control = None
        process, self._process = self._process, None
        is_clean = True
        if process is not None:
            _wait_exit(process, STOP_WAIT_S)
            if self.cgroup is not None:
                is_clean = self.cgroup.kill_all()
            else:
                procs.kill_pids([*procs.descendants(process.pid), process.pid])
            is_clean = _wait_exit(process, GRACE_S) and is_clean
            if self.uid is not None and self.cgroup is None:
                procs.kill_uid(self.uid)
                is_clean = is_clean and not procs.wait_uid_gone(self.uid, GRACE_S)
        if self._errors is not None:
            self._errors.close()  # type: ignore[attr-defined]
            self._errors = None
        self._infra = frozenset()
        self._pending = False
        _remove(self._scratch)
        return is_clean

    def _request(self, job: Job, limits: SandboxLimits, scratch: list[Path]) -> dict[str, object]:
        job_dir, cwd = launch.JOB_DIR_INSIDE, "/tmp"
        if self.session_limits is not None:
            cwd = launch.SESSION_DIR_INSIDE
        if self.bwrap is None:  # reduced mode: host directories stand in for the tmpfs
            job_dir, cwd = (str(_scratch_dir(self.uid, scratch)) for _ in range(2))
        candidate = None
        if job.judged is not None:
            if self.bwrap is None:
                raise SlotFailure("judged runs need bubblewrap: reduced mode cannot hide the tests")
            candidate = {"main": f"{job_dir}/{job.judged.candidate}",
                         "hide": f"{job_dir}/{job.judged.private}"}  # fmt: skip
        return {
            "candidate": candidate,
            "main": f"{job_dir}/{job.main}",
            "args": list(job.args),
            "cwd": cwd,
            "job_dir": job_dir,
            "rlimits": limits.rlimits(slot_tasks=NPROC_SLOT_TASKS),
            "tmp": {**_tmpfs_caps(limits), "slack_bytes": FS_SLACK_BYTES},
            "job": job.tmpfs_caps(),
        }

    def _apply_cgroup_limits(self, limits: SandboxLimits) -> None:
        wanted = (limits.cgroup_tasks(CGROUP_SLOT_TASKS), limits.cgroup_memory_bytes)
        if self.cgroup is not None and wanted != self._cgroup_limits:
            try:
                self.cgroup.set_limits(*wanted)
            except OSError as error:
                raise SlotFailure(f"could not set the slot's cgroup limits: {error}") from error
            self._cgroup_limits = wanted

    def _job_processes(self) -> list[int]:
        if self._process is None:
            return procs.live_processes_of_uid(self.uid) if self.uid is not None else []
        if self.uid is not None:
            return [pid for pid in procs.live_processes_of_uid(self.uid) if pid not in self._infra]
        return [pid for pid in procs.descendants(self._process.pid) if pid not in self._infra]

    def _receive(self, deadline: float) -> dict[str, object] | None:
        """One message from the server, or None on EOF, garbage or the deadline."""
        if self._control is None:
            return None
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0 or not ready([self._control], remaining_s):
            return None
        try:
            data = self._control.recv(1 << 16)
            message = json.loads(data) if data else None
        except (OSError, ValueError):
            return None
        return message if isinstance(message, dict) else None


def _wait_exit(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Reap `process` if it exits within `timeout_s` (a pidfd: no sleep-polling)."""
    if process.poll() is not None:
        return True
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:  # already reaped elsewhere, or no pidfd on this kernel
        return process.poll() is not None
    try:
        ready([pidfd], timeout_s)
    finally:
        os.close(pidfd)
    return process.poll() is not None


def _tmpfs_caps(limits: SandboxLimits) -> dict[str, int]:
    return {"bytes": limits.tmp_size_mb * MIB, "inodes": limits.max_files}


def _status_lines(data: bytes) -> list[dict[str, object]]:
    lines = []
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines


def _scratch_dir(uid: int | None, scratch: list[Path]) -> Path:
    path = Path(tempfile.mkdtemp(prefix="gapless-reduced-"))
    scratch.append(path)
    if uid is not None:
        os.chown(path, uid, uid)
    path.chmod(0o700)
    return path


def _remove(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    paths.clear()
