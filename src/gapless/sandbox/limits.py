"""Resource limits of one sandboxed run, and the rlimits derived from them.

`SandboxLimits` is the only knob a caller turns. Each field says which mechanism enforces it;
`rlimits()` turns the fields into the `setrlimit` calls that the in-sandbox bootstrap makes
before the program's first line runs, and `cgroup_tasks` / `cgroup_memory_bytes` into the
limits of the slot's cgroup (cgroups.py), which bind the run as a whole.

Guaranteed: every limit is validated on construction (a bad value raises `ValueError` naming
the field), and soft == hard for every rlimit except CPU, so the program cannot raise them.

Also set, with no field (the kernel-wide resources of seccomp.py's audit): RLIMIT_MEMLOCK 0,
RLIMIT_RTPRIO 0, RLIMIT_NICE 0, RLIMIT_MSGQUEUE `MSGQUEUE_BYTES`; and on a cgroup v1 host the
run's TCP/UDP buffers are capped at `SOCKET_MEMORY_MB` (v2 counts them in the memory limit).

NOT guaranteed: without a cgroup (not root, or no pids/memory hierarchy) `memory_mb` binds each
process alone, so a run may hold up to `max_processes * memory_mb`; with one, the run as a whole
is held to `cgroup_memory_bytes`, which also counts its tmpfs pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1 << 20
SERVER_MEMORY_MB = 64  # the slot's own processes (server, init) and page cache, per run
SOCKET_MEMORY_MB = 64  # TCP/UDP buffers of a run (cgroup v1 counts them apart from memory)
MSGQUEUE_BYTES = 819200  # POSIX message queues of the slot uid: the kernel's own default


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Defaults fit short unit-test programs on a 2-core CPU machine."""

    timeout_s: float = 5.0
    """Wall-clock deadline of the program, counted from its start line (written by the sandbox's
    start-up right before the program's first line: bwrap, the interpreter, the mounts and the
    harness's start-up in the sandbox are not the program's time; they have their own budget,
    worker.STARTUP_TIMEOUT_S, past which the run is infra_error). At it every process of the
    run is killed. Raise it for slow tests, not to paper over a loaded machine."""

    cpu_s: float | None = None
    """RLIMIT_CPU per process, in CPU seconds (rounded up; SIGXCPU at it, SIGKILL one second
    later). None derives ceil(timeout_s) + 1, so the wall deadline usually fires first and the
    CPU limit only stops multi-threaded spinning."""

    memory_mb: int = 512
    """RLIMIT_AS per process (address space, MiB). An allocation beyond it fails with
    MemoryError instead of pushing the host into swap or the OOM killer."""

    max_processes: int = 64
    """Tasks (processes and threads) of the program, itself included: the slot's pids cgroup
    (pids.max, plus the slot's own few processes) and RLIMIT_NPROC, counted in the run's user
    namespace and slot uid, so runs do not starve each other."""

    tmp_size_mb: int = 64
    """Size of the run's private tmpfs at /tmp (the same one is seen at /dev/shm), MiB; the
    only writable place. Its pages count against the run's memory cgroup."""

    max_files: int = 10000
    """Inodes of that tmpfs (nr_inodes): files, directories and links the program may create.
    A million-file flood stops here with ENOSPC (status inode_limit)."""

    max_file_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write, MiB (EFBIG beyond it)."""

    max_output_bytes: int = 65536
    """stdout and stderr are each kept up to this many bytes; the rest is read and discarded."""

    max_open_files: int = 256
    """RLIMIT_NOFILE: open file descriptors per process."""

    def __post_init__(self) -> None:
        positive = {
            "timeout_s": self.timeout_s,
            "memory_mb": self.memory_mb,
            "max_processes": self.max_processes,
            "tmp_size_mb": self.tmp_size_mb,
            "max_file_mb": self.max_file_mb,
            "max_output_bytes": self.max_output_bytes,
            "max_open_files": self.max_open_files,
            "max_files": self.max_files,
        }
        if self.cpu_s is not None:
            positive["cpu_s"] = self.cpu_s
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError(
                f"SandboxLimits.max_open_files must be >= 16 (python needs a few), got {self.max_open_files}"
            )

    @property
    def cpu_limit_s(self) -> int:
        """RLIMIT_CPU soft limit in whole seconds (explicit `cpu_s` or the derived default)."""
        cpu_s = self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1
        return max(1, math.ceil(cpu_s))

    @property
    def cgroup_memory_bytes(self) -> int:
        """Memory cgroup limit of the run as a whole: one process's address space, the tmpfs
        it may fill, and the slot's own processes. A bomb split over many processes stops here
        (SIGKILL by the kernel, status memory_limit)."""
        return (self.memory_mb + self.tmp_size_mb + SERVER_MEMORY_MB) * MIB

    @property
    def cgroup_socket_bytes(self) -> int:
        """TCP/UDP buffer memory of the run as a whole, where the cgroup counts it apart from
        `cgroup_memory_bytes` (v1); past it the run's sockets are under memory pressure (sends
        wait), instead of taking the host's net.ipv4.tcp_mem."""
        return SOCKET_MEMORY_MB * MIB

    def cgroup_tasks(self, slot_tasks: int) -> int:
        """pids.max of the slot: the program's tasks plus the slot's own `slot_tasks`."""
        return self.max_processes + slot_tasks

    def rlimits(self, slot_tasks: int = 0) -> dict[str, tuple[int, int]]:
        """`resource` constant name -> (soft, hard), as the bootstrap applies them.
        `slot_tasks`: processes of the slot uid in the run's user namespace that are not the
        program's (bwrap's pid 1, the server, init); RLIMIT_NPROC counts them too."""
        nproc = self.max_processes + slot_tasks + 8  # the pids cgroup, with its counter, first
        return {
            "RLIMIT_CPU": (self.cpu_limit_s, self.cpu_limit_s + 1),
            "RLIMIT_AS": (self.memory_mb * MIB, self.memory_mb * MIB),
            "RLIMIT_FSIZE": (self.max_file_mb * MIB, self.max_file_mb * MIB),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_NPROC": (nproc, nproc),
            "RLIMIT_CORE": (0, 0),
            # Set here, never inherited from the host (seccomp.py's audit says why each):
            "RLIMIT_MEMLOCK": (0, 0),
            "RLIMIT_MSGQUEUE": (MSGQUEUE_BYTES, MSGQUEUE_BYTES),
            "RLIMIT_RTPRIO": (0, 0),
            "RLIMIT_NICE": (0, 0),
        }
