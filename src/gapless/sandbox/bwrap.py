"""Run untrusted Python programs in bubblewrap sandboxes, from a pool of prepared slots.

`BwrapSandbox.run_python(files, main)` runs `/work/job/<main>` over read-only `files`, with cwd
/tmp, under `SandboxLimits`, and returns a `SandboxResult`. It is thread-safe, never raises for
anything the program does, retries an infrastructure failure (or an unexplained death, KILLED)
once on another slot and reports that second result: `Status.INFRA_ERROR` if it fails too (`check()` raises instead). `arun_python` is the same for
coroutines, spawning on the pool's threads. `warm=True` (the default) forks each job from a
pre-started server in the slot; `warm=False` starts bwrap and a fresh interpreter per job. Both
run the same code inside the sandbox (boot.py) and give the same guarantees, except as listed.

Threat model: the program is hostile model output that may loop, allocate, fork, flood output,
fill the disk with bytes or files, open sockets, read secrets, spawn daemons, attack the
sandbox's own processes or fake its results. Each defence, outermost first:
- Privilege: as root, each slot runs as its own unprivileged host uid/gid with no supplementary
  groups (slots.py). bwrap started by root keeps every capability in its namespace (measured: it
  remounted a read-only bind read-write and wrote to the host), and `--uid` maps to host root.
- Namespaces: user (nested inside bwrap's, with user namespaces disabled: no further one, which
  could mount a tmpfs without limits), pid, network (loopback only; host loopback unreachable),
  IPC, UTS and cgroup; `--new-session` (no TIOCSTI), `--die-with-parent`. Each job then gets its
  own pid, mount and IPC namespaces, so it can neither see nor signal the slot's server, and
  SysV IPC objects do not outlive it.
- Capabilities: bwrap drops all but CAP_SYS_ADMIN of the slot's innermost user namespace, which
  only the server and each job's init keep (to make namespaces and mount tmpfs). The program
  drops it (and every other set) before its first line, and start-up aborts unless /proc shows
  none left. Holding capabilities the program lacks also stops it from ptracing init or the
  server or opening their fds through /proc.
- Filesystem: read-only /usr with the /bin, /lib, /lib64, /sbin links, fresh /proc (the job's
  pids only) and /dev (read-only); the job's files on a read-only tmpfs at /work/job; one
  tmpfs with size AND inode caps at /tmp (also /dev/shm), fresh for every job and gone with its
  mount namespace. The root is read-only. No /etc, /home, /root, host /tmp or repository.
- Resources: per-slot cgroup (pids.max, a memory limit for the run as a whole, CPU accounting)
  where root and a pids+memory hierarchy exist (cgroups.py); rlimits always: CPU, AS, FSIZE,
  NOFILE, NPROC, CORE=0, set in the program before its first line.
- Time and cleanup: the host owns the wall deadline. At it, every process of the slot except
  the server, bwrap's pid 1 and the bwrap monitor gets SIGKILL (cgroup.procs, or the server's
  descendants without a cgroup); a job's init dying takes its whole pid namespace with it,
  daemons included. Before a slot's next job it must hold nothing but its server, or the server
  is restarted; a slot that cannot be emptied is quarantined. `--die-with-parent` takes every
  sandbox down with this process; servers are started from the pool's long-lived threads,
  because the kernel sends that parent-death signal when the forking *thread* exits.
- Syscalls: a seccomp filter (seccomp.py) installed by every program before its first line:
  no keyrings, io_uring, inotify/fanotify/dnotify, file locks, ptrace or process_vm_*, bpf,
  userfaultfd, perf_event_open, mount family, modules, kexec; sockets AF_UNIX, AF_INET and
  AF_INET6 only (no AF_VSOCK past the network namespace). Each job joins a fresh session
  keyring, and the server makes its cgroup namespace after joining the slot's cgroup, so
  /proc/self/cgroup shows `/`, not the host's path.
- Kernel-wide resources (seccomp.py's audit; docs/sandbox.md): no legacy AIO, no
  memfd_secret, no page-cache residency calls; the slot's own devpts with a pty cap; TCP/UDP
  buffers charged to the run (v1: a socket limit of their own); RLIMIT_MEMLOCK, RTPRIO, NICE
  0; on v1 the jobs run in a memory cgroup below the server's, so the OOM killer of their
  limit cannot choose the server, and the page cache they were first to read is evicted after
  each job (no cache-timing channel between consecutive jobs).
- Output: stdout and stderr capped at `max_output_bytes`, the report fd at 1 MiB, the rest
  drained. The environment is cleared; stdin is /dev/null.
- Results: fd 3 (report) is a pipe only the host reads. A judged job (`judged=`, envs/code/environment.py)
  runs the candidate in a process of its own (pid, mount namespace and session of its own,
  the private files covered) that talks to the judge in plain values only, so the candidate
  never holds the tests, the report or the comparison. INFRA_ERROR needs host-side evidence
  the program cannot produce (the start line missing from the status pipe, which the program
  cannot write; a failure of the pool's own); a death no limit explains is the program's
  KILLED, run once more on a fresh slot (result.py, docs/sandbox.md "Who is blamed").

Warm path vs cold path, precisely. A warm job is forked from a server that imported a fixed list
of standard modules (worker.PREIMPORT), so: (1) `str` hashes use one seed for all jobs of a
server (a new server every 1000 jobs); (2) those modules are already in `sys.modules` (`random`
reseeds itself from os.urandom in every fork); (3) the jobs of a slot run one after another in
the slot's network namespace, where nothing of a finished job survives (its sockets die with
it) except TCP TIME_WAIT entries, which may refuse a later job's bind to the same port without
SO_REUSEADDR; (4) the run shares its memory cgroup with the idle server (a few MiB). Job
data never passes through the server (it reaches init in a memfd after the fork), so a job
cannot find an earlier job's files in memory it inherited. Everything else above holds for
both paths, including a fresh pid, mount and IPC namespace and a fresh /tmp per job.

NOT guaranteed:
- The seccomp filter is a deny-list: every other syscall of the shared host kernel is reachable,
  and a kernel bug there escapes. Namespaces, no capabilities, NoNewPrivs and the filter are
  the wall.
- /proc shows host-wide facts (cpuinfo, meminfo, uptime, loadavg), not other processes.
- Timing side channels and CPU contention between concurrent runs (the page cache of /usr
  among them: about 25 kbit/s); CPU is accounted, not shared fairly.
- Without root: no slot uid and no cgroup, so memory is per process only and leftovers are
  contained by the pid namespace alone (logged at start).
- Files written but not closed by the program are not flushed at its exit (os._exit), unlike
  a normal interpreter exit; they live in its tmpfs, which dies with it anyway.
"""

from __future__ import annotations

import logging
import os
import shutil
import weakref
from pathlib import Path
from typing import Sequence

from gapless.sandbox.cgroups import CgroupRoot
from gapless.sandbox.cow import SessionBase
from gapless.sandbox.job import Job, Judged
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.pool import BWRAP_MISSING, SlotPool
from gapless.sandbox.result import SandboxError, SandboxResult, Status

logger = logging.getLogger(__name__)

SLOT_LOCK_DIR = Path("/run/gapless-sandbox")  # flock files that keep slot uids unique per host
_CHECK_HINTS = (
    ("namespace", "user namespaces must be enabled: sysctl -w user.max_user_namespaces=15000"),
    ("uid map", "user namespaces must be enabled: sysctl -w user.max_user_namespaces=15000"),
    ("execvp", "the interpreter must exist inside the sandbox, where only /usr is visible"),
    ("Operation not permitted", "the kernel refused a namespace or mount: is bwrap setuid, or "
                                "are unprivileged user namespaces restricted (AppArmor)?"),
)  # fmt: skip


class BwrapSandbox:
    """Runs Python programs in bubblewrap, one job per slot at a time (see module docstring)."""

    mode = "bwrap"

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        python: str = "/usr/bin/python3",
        slot_uid_base: int = 200000,
        *,
        warm: bool = True,
        max_concurrency: int | None = None,
    ) -> None:
        self.limits = limits
        self.python = python
        self.slot_uid_base = slot_uid_base
        self.max_concurrency = max_concurrency or 4 * (os.cpu_count() or 1)
        is_root = os.geteuid() == 0
        cgroups, self.cgroup_note = CgroupRoot.detect() if is_root else (None, "not root")
        if cgroups is None:
            logger.warning("sandbox: no per-slot cgroup (%s)", self.cgroup_note)
        self._pool = SlotPool(
            python=python,
            bwrap=shutil.which("bwrap"),
            warm=warm,
            max_concurrency=self.max_concurrency,
            uid_base=slot_uid_base if is_root else None,
            cgroups=cgroups,
            lock_dir=_slot_lock_dir() if is_root else None,
            is_reduced=self.mode == "reduced",
        )
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def has_cgroups(self) -> bool:
        """Whether each slot has its own cgroup (run-wide pids and memory limits)."""
        return self._pool.cgroups is not None

    @property
    def path(self) -> str:
        """The path jobs take: warm, cold or reduced."""
        return self._pool.path

    @property
    def quarantined_uids(self) -> frozenset[int]:
        """Slot uids that could not be emptied after a run; they are never used again."""
        return frozenset(self.slot_uid_base + index for index in self._pool.quarantined)

    def check(self) -> None:
        """Raise `SandboxError` saying what to fix unless a trivial program runs correctly."""
        if self.mode == "bwrap" and self._pool.bwrap is None:
            raise SandboxError(BWRAP_MISSING)
        if not (os.access(self.python, os.X_OK) and Path(self.python).resolve().is_relative_to("/usr")):
            raise SandboxError(
                f"python {self.python!r} is not an executable under /usr, the only host tree "
                "visible in the sandbox: install python3 (apt-get install python3) or pass "
                "python='/usr/bin/python3'"
            )
        result = self.run_python({"check.py": "print('ok')\n"}, "check.py")
        if result.status is not Status.OK or result.stdout != "ok\n":
            detail = (result.stderr or result.stdout).strip()[-2000:]
            hints = [hint for key, hint in _CHECK_HINTS if key in detail]
            raise SandboxError(
                f"sandbox self-test failed with status {result.status.value}: {detail!r}"
                + "".join(f"; {hint}" for hint in hints)
            )

    def run_file(self, path: str | Path, limits: SandboxLimits | None = None) -> SandboxResult:
        """Run one Python file (host path) as the program."""
        path = Path(path)
        return self.run_python({path.name: path.read_bytes()}, path.name, limits=limits)

    def run_python(
        self,
        files: dict[str, str | bytes],
        main: str,
        args: Sequence[str] = (),
        limits: SandboxLimits | None = None,
        judged: Judged | None = None,
    ) -> SandboxResult:
        """Run /work/job/<main> with `args` as `python -I -B` would, over `files` (relative
        path -> content), with cwd /tmp. Blocks while `max_concurrency` runs are in flight.
        `judged`: main is a judge and `judged.candidate` runs in a process of its own that
        cannot read the files under `judged.private` (module docstring; bwrap mode only).

        Raises ValueError only for a malformed call (bad file names, `main` not in `files`).
        """
        return self._pool.run(Job.of(files, main, list(args), judged), limits or self.limits)

    async def arun_python(
        self,
        files: dict[str, str | bytes],
        main: str,
        args: Sequence[str] = (),
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """`run_python` for coroutines: queued for the pool's threads, never blocking the loop."""
        return await self._pool.arun(Job.of(files, main, list(args)), limits or self.limits)

    def open_session(self, limits: SandboxLimits | None = None, idle_timeout_s: float = 300.0,
                     base: SessionBase | None = None):  # fmt: skip
        """A stateful sandbox for multi-turn tool use (session.py); close it when done. `base`:
        /work/session is a copy-on-write view of `base.tree` (cow.py; needs root)."""
        from gapless.sandbox.session import SandboxSession

        if self.mode != "bwrap":
            raise SandboxError("sessions need bubblewrap; reduced mode has no private filesystem")
        if base is not None and self._pool.uid_base is None:
            raise SandboxError("copy-on-write sessions need root (slot uids): run as root or give each episode a copy")
        return SandboxSession(self._pool, limits or self.limits, idle_timeout_s, base)

    def metrics(self) -> dict[str, float]:
        """`sandbox/*` counters (`*_total`) and recent queue and run latency percentiles."""
        return self._pool.metrics()

    def leftovers(self) -> list[str]:
        """What finished runs left behind (empty when clean); see `SlotPool.leftovers`."""
        return self._pool.leftovers()

    def close(self) -> None:
        """Stop every slot's server and remove its cgroup. Also runs at interpreter exit."""
        self._finalizer()

    def __enter__(self) -> BwrapSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slot_lock_dir() -> Path:
    try:
        SLOT_LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    except OSError as error:
        raise SandboxError(f"cannot create {SLOT_LOCK_DIR} for slot locks: {error}") from error
    return SLOT_LOCK_DIR
