"""Resource limits of one sandboxed run, and the rlimits derived from them.

`SandboxLimits` is the only knob a caller turns. Each field says which mechanism enforces it;
`rlimits()` turns the fields into the `setrlimit` calls that the in-sandbox bootstrap makes
before the program's first line runs.

Guaranteed: every limit is validated on construction (a bad value raises `ValueError` naming
the field), and soft == hard for every rlimit except CPU, so the program cannot raise them.

NOT guaranteed (no cgroup yet): `memory_mb` and `max_file_mb` are per process, so a run may hold
up to `max_processes * memory_mb` of address space; tmpfs pages are not counted in `memory_mb`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Defaults fit short unit-test programs on a 2-core CPU machine."""

    timeout_s: float = 5.0
    """Wall-clock deadline for the whole run, sandbox start-up included; at it every process of
    the run is killed. Raise it for slow tests, not to paper over a loaded machine."""

    cpu_s: float | None = None
    """RLIMIT_CPU per process, in CPU seconds (rounded up; SIGXCPU at it, SIGKILL one second
    later). None derives ceil(timeout_s) + 1, so the wall deadline usually fires first and the
    CPU limit only stops multi-threaded spinning."""

    memory_mb: int = 512
    """RLIMIT_AS per process (address space, MiB). An allocation beyond it fails with
    MemoryError instead of pushing the host into swap or the OOM killer."""

    max_processes: int = 64
    """RLIMIT_NPROC: tasks (processes and threads) of the run, its pid-1 reaper included (so
    the program may fork max_processes - 2 times). Counted inside the run's user namespace,
    so runs do not starve each other (and each has its own slot uid besides)."""

    tmp_size_mb: int = 64
    """Size of the private writable tmpfs at /tmp (bwrap --size), MiB. /dev/shm gets its own
    tmpfs of the same size; nothing else is writable."""

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
        }
        if self.cpu_s is not None:
            positive["cpu_s"] = self.cpu_s
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError(
                f"SandboxLimits.max_open_files must be >= 16 (python needs a few), "
                f"got {self.max_open_files}"
            )

    @property
    def cpu_limit_s(self) -> int:
        """RLIMIT_CPU soft limit in whole seconds (explicit `cpu_s` or the derived default)."""
        cpu_s = self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1
        return max(1, math.ceil(cpu_s))

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """`resource` constant name -> (soft, hard), as the bootstrap applies them."""
        nproc = self.max_processes
        return {
            "RLIMIT_CPU": (self.cpu_limit_s, self.cpu_limit_s + 1),
            "RLIMIT_AS": (self.memory_mb * MIB, self.memory_mb * MIB),
            "RLIMIT_FSIZE": (self.max_file_mb * MIB, self.max_file_mb * MIB),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_NPROC": (nproc, nproc),
            "RLIMIT_CORE": (0, 0),
        }
