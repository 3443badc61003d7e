"""Run untrusted Python programs in a fresh bubblewrap sandbox, one run per call.

`BwrapSandbox.run_python(files, main)` writes `files` into a host temp dir, binds it read-only
at /work/job, runs `/work/job/<main>` under the limits of `SandboxLimits` with cwd /tmp, and
returns a `SandboxResult`. It is thread-safe and never raises for anything the program does;
a sandbox that fails to start gives `Status.INFRA_ERROR` (`check()` raises instead).

Threat model: the program is hostile model output that may loop, allocate, fork, flood output,
write files, open sockets, read secrets, spawn daemons or fake its results. Each defence:
- Privilege: as root, bwrap runs as the slot's own unprivileged host uid/gid with no
  supplementary groups. bwrap started by root keeps every capability in its namespace (measured:
  it remounted a read-only bind read-write and wrote to the host), and `--uid` maps to host root.
- Namespaces: `--unshare-all --unshare-user --disable-userns` (own user, pid, net, ipc, uts and
  cgroup namespaces; no nested user namespace, which could mount an unlimited tmpfs),
  `--cap-drop ALL`, `--new-session` (no TIOCSTI into our terminal), `--die-with-parent`.
- Filesystem: read-only /usr plus the /bin, /lib, /lib64, /sbin links, the job read-only at
  /work/job, fresh /proc and /dev. Writable: /tmp and /dev/shm, two tmpfs of `tmp_size_mb`
  each; `/` and `/dev` are remounted read-only (bwrap leaves both as unbounded writable tmpfs).
  No /etc, /home, /root, /work of the host or the repository.
- Network: a private network namespace with only loopback; host loopback is unreachable.
- Limits: rlimits CPU, AS, FSIZE, NOFILE, NPROC and CORE=0 are set by the bootstrap (boot.py)
  before the program runs, so they bind it and its children but not bwrap. Set inside the
  run's user namespace, NPROC counts that run only (kernel >= 5.14; measured on 6.18); the
  per-run slot uid (slots.py) keeps it per run on older kernels too.
- Time and cleanup: the bootstrap stays pid 1 of the run's pid namespace and reaps; when the
  program exits, or the wall deadline SIGKILLs that pid 1, the kernel kills the whole namespace
  (daemons included). Afterwards the host scans /proc for the slot uid, kills anything left,
  and quarantines that slot for good.
- Output: stdout and stderr are capped (`max_output_bytes`) and the report fd at 1 MiB; the rest
  is drained. Environment variables are cleared; stdin is /dev/null.
- Attribution: INFRA_ERROR only if the bootstrap's start marker is missing (result.py).
- The interpreter must live under /usr (the only host tree inside); it starts with `-I -B`,
  so no environment variable, user site or job file runs before the limits are set.

NOT guaranteed (a later issue adds cgroups, seccomp, slot pools):
- No seccomp filter: every syscall of the shared host kernel is reachable; a kernel bug escapes.
- No cgroup: memory is capped per process only (a run can hold max_processes * memory_mb) and
  CPU is not shared fairly between runs.
- No inode cap: the tmpfs caps bytes, not file count (millions of empty files are possible).
- /proc shows host-wide facts (cpuinfo, meminfo, uptime), not other processes.
- Timing side channels and CPU contention between runs.
- ptrace between the run's own processes (no Yama on this kernel), the pid-1 reaper included;
  it holds nothing the program does not have.
- Without root there is no per-run uid: runs share the caller's uid, so leftover processes are
  contained by the pid namespace only, not verified by a uid scan (and on kernels before 5.14
  RLIMIT_NPROC would count all of the caller's processes).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Sequence

from gapless.sandbox import launch, procs
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.result import SandboxError, SandboxResult, Status, classify
from gapless.sandbox.slots import SlotAllocator

logger = logging.getLogger(__name__)

BWRAP_MISSING = "bwrap not found on PATH: install bubblewrap (apt-get install bubblewrap)"
SLOT_LOCK_DIR = Path("/run/gapless-sandbox")  # flock files that keep slot uids unique per host
CLEANUP_GRACE_S = 1.0
_CHECK_HINTS = (
    ("namespace", "user namespaces must be enabled: sysctl -w user.max_user_namespaces=15000"),
    ("uid map", "user namespaces must be enabled: sysctl -w user.max_user_namespaces=15000"),
    ("execvp", "the interpreter must exist inside the sandbox, where only /usr is visible"),
    ("source path", "slot uids must be able to reach tempfile.gettempdir(): set TMPDIR=/tmp"),
)


class BwrapSandbox:
    """Runs Python programs in bubblewrap; one fresh sandbox and one slot uid per run."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        python: str = "/usr/bin/python3",
        slot_uid_base: int = 200000,
    ) -> None:
        self.limits = limits
        self.python = python
        self.slot_uid_base = slot_uid_base
        self._bwrap = shutil.which("bwrap")
        self._is_root = os.geteuid() == 0
        self._slots = SlotAllocator(slot_uid_base, _slot_lock_dir() if self._is_root else None)

    @property
    def quarantined_uids(self) -> frozenset[int]:
        """Slot uids that had processes left after a run; they are never used again."""
        return frozenset(self.slot_uid_base + index for index in self._slots.quarantined)

    def check(self) -> None:
        """Raise `SandboxError` saying what to fix unless a trivial program runs correctly."""
        if self._bwrap is None:
            raise SandboxError(BWRAP_MISSING)
        if not _is_python_usable(self.python):
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
    ) -> SandboxResult:
        """Run /work/job/<main> with `args` as `python -I -B` would (through boot.py), over
        `files` (relative path -> content), with cwd /tmp.

        Raises ValueError only for a malformed call (bad file names, `main` not in `files`).
        """
        _check_job(files, main)
        limits = limits or self.limits
        slot = self._slots.acquire()
        uid = self.slot_uid_base + slot if self._is_root else None
        is_clean = False
        try:
            result = self._run_job(files, main, list(args), limits, uid)
            is_clean = uid is None or _is_uid_clean(uid)
        finally:
            self._slots.release(slot, is_clean=is_clean)
        return result

    def _run_job(
        self,
        files: dict[str, str | bytes],
        main: str,
        args: list[str],
        limits: SandboxLimits,
        uid: int | None,
    ) -> SandboxResult:
        if self._bwrap is None:
            return _infra_result(BWRAP_MISSING)
        try:
            job_dir = _write_job_dir(files, owner_uid=uid)
        except OSError as error:
            return _infra_result(f"could not write the job directory: {error}")
        try:
            output = launch.execute(
                launch.bwrap_argv(self._bwrap, job_dir, limits),
                self.python,
                [f"{launch.JOB_DIR_INSIDE}/{main}", *args],
                limits,
                launch_uid=uid,
            )
        finally:
            _remove_job_dir(job_dir)
        return _to_result(output, limits)


def _to_result(output: launch.RunOutput, limits: SandboxLimits) -> SandboxResult:
    status, limit, exit_code, signum = classify(output.seen)
    stderr = output.seen.stderr.decode("utf-8", errors="replace")
    if status is Status.INFRA_ERROR and not stderr.strip():
        stderr = (
            f"sandbox did not start the program within timeout_s={limits.timeout_s}"
            if output.seen.is_deadline_hit
            else f"bwrap exited with code {output.seen.returncode} before the program started"
        )
    return SandboxResult(
        status=status,
        exit_code=exit_code,
        signal=signum,
        stdout=output.stdout.decode("utf-8", errors="replace"),
        stderr=stderr,
        wall_s=output.wall_s,
        truncated=output.seen.is_truncated,
        limit=limit,
        report=output.report if status is not Status.INFRA_ERROR else b"",
    )


def _infra_result(message: str) -> SandboxResult:
    return SandboxResult(Status.INFRA_ERROR, None, None, "", message, 0.0, False, None, b"")


def _check_job(files: dict[str, str | bytes], main: str) -> None:
    for name in files:
        parts = PurePosixPath(name).parts
        if not parts or name.startswith("/") or ".." in parts or str(PurePosixPath(name)) != name:
            raise ValueError(f"file name {name!r} must be a normalised relative path")
    if main not in files:
        raise ValueError(f"main {main!r} is not one of the files {sorted(files)}")


def _slot_lock_dir() -> Path:
    try:
        SLOT_LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    except OSError as error:
        raise SandboxError(f"cannot create {SLOT_LOCK_DIR} for slot locks: {error}") from error
    return SLOT_LOCK_DIR


def _is_python_usable(python: str) -> bool:
    return os.access(python, os.X_OK) and Path(python).resolve().is_relative_to("/usr")


def _write_job_dir(files: dict[str, str | bytes], owner_uid: int | None) -> Path:
    """Fresh host dir holding `files`; owned by the slot uid (mode 0500) when running as root,
    so only that run can enter it. Modes inside are explicit, whatever our umask."""
    job_dir = Path(tempfile.mkdtemp(prefix="gapless-job-"))
    for name, content in files.items():
        path = job_dir / name
        for parent in reversed(path.relative_to(job_dir).parents[:-1]):
            (job_dir / parent).mkdir(exist_ok=True)
            (job_dir / parent).chmod(0o755)
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        path.chmod(0o444)
    if owner_uid is not None:
        os.chown(job_dir, owner_uid, owner_uid)
        job_dir.chmod(0o500)
    return job_dir


def _is_uid_clean(uid: int) -> bool:
    """After a run: no process of the slot uid may be left. Kill and report any that are."""
    live = procs.live_processes_of_uid(uid)
    if live:
        logger.warning("sandbox uid %d: killing %d leftover processes %s", uid, len(live), live)
        procs.kill_uid(uid)
    left = procs.wait_uid_gone(uid, CLEANUP_GRACE_S)
    if left:
        logger.warning("sandbox uid %d: processes remain after cleanup: %s", uid, left)
    return not live and not left


def _remove_job_dir(job_dir: Path) -> None:
    try:
        shutil.rmtree(job_dir)
    except OSError as error:  # the result stays valid; the leak is logged, not fatal
        logger.warning("sandbox: could not remove job dir %s: %s", job_dir, error)
