"""Per-slot cgroups: a pids and a memory limit for a whole run, the list of its processes, and
counters that say which limit fired.

Where: `<this process's own cgroup>/gapless-sandbox/uid-<slot uid>` in each hierarchy; v1 (one
hierarchy per controller, pids and memory required, cpuacct used when present) or
v2 (one unified hierarchy with the pids and memory controllers delegated to us). Nesting under
our own cgroup keeps the runs inside whatever memory budget the service itself was given. The
slot uid's flock (slots.py) makes each directory's user unique on the host, so `sweep` may
remove the directory of any uid whose flock it can take: its owner has died.

Only root may create these; elsewhere `CgroupRoot.detect` returns None and a note that says why,
and limits fall back to per-process rlimits.

The server is out of the OOM killer's reach of its jobs (v1): the slot's memory cgroup holds
the server and one child, `jobs`, with the run's memory limit, holding the server's forker and
so every job (boot.py); the slot's own limit is the jobs' plus `SERVER_MEMORY_MB`. A job's
memory pressure hits the child's limit first, where the OOM killer chooses among the forker
and the job's processes only; the counters read the child's OOM kills. v2 keeps one directory
per slot (its "no processes in inner nodes" rule would need a child for the server too): there
the server is protected by oom_score_adj alone (worker.py, launch.set_oom_floor).

Why no freezer: every process the kill targets lives in a pid namespace whose init is among the
targets (a job's init, or the slot's server), and the kernel kills a namespace as a whole when
its init dies, so a fork racing the scan cannot survive. Moving a task between v1 cgroups costs
an RCU grace period (milliseconds under load), so only the server is moved, once per server
start; everything it forks inherits the cgroups.

Guaranteed: every wait is bounded. NOT guaranteed: a removed directory when a process is stuck
in uninterruptible sleep (`remove` returns False and the slot is quarantined).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gapless.sandbox.limits import MIB, SERVER_MEMORY_MB, SOCKET_MEMORY_MB

PARENT_NAME = "gapless-sandbox"
WAIT_S = 2.0
POLL_S = 0.002
V1_REQUIRED, V1_OPTIONAL = ("pids", "memory"), ("cpuacct",)
SOCKET_BYTES = SOCKET_MEMORY_MB * MIB
SERVER_MEMORY_BYTES = SERVER_MEMORY_MB * MIB  # v1: the slot's limit over its jobs' limit
JOB_MEMORY_NAME = "jobs"


@dataclass(frozen=True)
class CgroupCounters:
    """Monotonic counters of one slot; a run's evidence is the difference across it."""

    oom_kills: int  # processes killed by the kernel for the memory limit
    pids_max_hits: int  # forks refused by pids.max
    cpu_ns: int | None  # CPU time of every process of the slot (None: no cpu accounting)


class SlotCgroup:
    """The cgroup directories of one slot (one per v1 controller, or one v2 directory)."""

    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        self.dirs = dirs  # controller -> directory; v2: every controller -> the same one
        self.version = version
        # v1: the jobs' memory cgroup, a child of the slot's, holding the forker and every job
        # (boot.py): the OOM killer of its limit can only choose among them, never the server.
        self.job_memory = dirs["memory"] / JOB_MEMORY_NAME if version == 1 else None
        self._procs_file = str(dirs["pids"] / "cgroup.procs")
        self._pids_events_file = str(dirs["pids"] / "pids.events")
        if self.job_memory is not None:
            self._oom_file = str(self.job_memory / "memory.oom_control")
            cpuacct = dirs.get("cpuacct")
            self._cpu_file = str(cpuacct / "cpuacct.usage") if cpuacct else None
        else:
            self._oom_file = str(dirs["memory"] / "memory.events")
            self._cpu_file = str(dirs["memory"] / "cpu.stat")

    def set_limits(self, max_tasks: int, memory_bytes: int, socket_bytes: int = SOCKET_BYTES) -> None:
        """`socket_bytes`: TCP/UDP buffers, which v1 charges only under a limit of their own
        (without one they take the host-wide net.ipv4.tcp_mem/udp_mem); v2 charges them to
        memory.max with the rest."""
        if self.version == 1 and self.job_memory is not None:
            _write(self.dirs["pids"] / "pids.max", max_tasks)
            slot_bytes = memory_bytes + SERVER_MEMORY_BYTES
            for memory, limit in ((self.dirs["memory"], slot_bytes), (self.job_memory, memory_bytes)):
                _write_v1_memory_limit(memory, limit)
            if (self.job_memory / "memory.kmem.tcp.limit_in_bytes").exists():
                _write(self.job_memory / "memory.kmem.tcp.limit_in_bytes", socket_bytes)
        else:
            _write(self.dirs["pids"] / "pids.max", max_tasks)
            _write(self.dirs["memory"] / "memory.max", memory_bytes)
            if (self.dirs["memory"] / "memory.swap.max").exists():
                _write(self.dirs["memory"] / "memory.swap.max", 0)

    def ensure(self) -> bool:
        """Make the directories if they are missing; True if any was."""
        made = False
        for directory in self._all_dirs():
            if not directory.is_dir():
                directory.mkdir(parents=True, exist_ok=True)
                made = True
        return made

    def attach(self, pid: int) -> None:
        """Move `pid` into every controller of the slot (its later children follow it)."""
        for directory in set(self.dirs.values()):
            _write(directory / "cgroup.procs", pid)

    def attach_forker(self, pid: int) -> None:
        """Move the slot's forker (boot.py) in: as `attach`, but into the jobs' memory cgroup
        (v1), so that every job it forks is there too. Once per server start: a move costs."""
        for name, directory in self.dirs.items():
            if name == "memory" and self.job_memory is not None:
                directory = self.job_memory
            _write(directory / "cgroup.procs", pid)

    def drop_page_cache(self) -> None:
        """Evict the page cache charged to the jobs' memory cgroup (v1): the pages of the shared
        read-only files that a job was the first to read, so the next job cannot time a read
        to learn which (a channel between consecutive jobs). Pages still mapped by a process
        stay; the server's and the host's pages are charged elsewhere and stay warm."""
        if self.job_memory is not None:
            try:
                _write(self.job_memory / "memory.force_empty", 0)
            except OSError:  # the cgroup was removed meanwhile, or the kernel refused
                pass

    def _all_dirs(self) -> list[Path]:
        """Every directory of the slot, parents before children."""
        dirs = sorted(set(self.dirs.values()))
        return dirs + ([self.job_memory] if self.job_memory is not None else [])

    def pids(self) -> set[int]:
        """Processes of the slot (the pids hierarchy's view: every process is attached to all
        of the slot's directories at once, and its children follow it in each)."""
        try:
            return {int(line) for line in _read(self._procs_file).split()}
        except FileNotFoundError:
            return set()

    def counters(self) -> CgroupCounters:
        """Read on every run, twice: plain os.read on precomputed paths (pathlib costs more
        than the reads themselves)."""
        oom = _keyed(_read(self._oom_file)).get("oom_kill", 0)
        hits = _keyed(_read(self._pids_events_file)).get("max", 0)
        cpu_ns = None
        if self._cpu_file is not None:
            text = _read(self._cpu_file)
            cpu_ns = int(text) if self.version == 1 else _keyed(text).get("usage_usec", 0) * 1000
        return CgroupCounters(oom_kills=oom, pids_max_hits=hits, cpu_ns=cpu_ns)

    def kill_all(self, keep: frozenset[int] = frozenset(), timeout_s: float = WAIT_S) -> bool:
        """SIGKILL every process of the slot except `keep`; True once none is left."""
        for _ in range(20):
            targets = self.pids() - keep
            if not targets:
                break
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return self.wait_only(keep, timeout_s)

    def wait_only(self, keep: frozenset[int], timeout_s: float) -> bool:
        """Wait until the slot holds no process outside `keep`; True if it got there."""
        deadline = time.monotonic() + timeout_s
        while self.pids() - keep:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def remove(self) -> bool:
        """Kill what is left and remove the directories; False if one could not be removed."""
        self.kill_all()
        removed = True
        for directory in reversed(self._all_dirs()):
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
        return removed


class CgroupRoot:
    """The `gapless-sandbox` parent directories under which slot cgroups are made."""

    def __init__(self, parents: dict[str, Path], version: int) -> None:
        self.parents = parents
        self.version = version

    @classmethod
    def detect(cls, proc: Path = Path("/proc/self")) -> tuple[CgroupRoot | None, str]:
        """(root, note): root None when cgroups cannot be used here, and the note says why."""
        if os.geteuid() != 0:
            return None, "cgroups need root; limits are per-process rlimits only"
        mounts = _cgroup_mounts(proc / "mountinfo")
        own = _own_cgroups(proc / "cgroup")
        if all(name in mounts for name in V1_REQUIRED):
            parents = {
                name: mounts[name] / own.get(name, "/").lstrip("/") / PARENT_NAME
                for name in (*V1_REQUIRED, *V1_OPTIONAL) if name in mounts
            }  # fmt: skip
            return cls._made(parents, 1)
        if "" in mounts:
            return cls._detect_v2(mounts[""] / own.get("", "/").lstrip("/"))
        return None, "no cgroup hierarchy with pids and memory; limits are rlimits only"

    @classmethod
    def _detect_v2(cls, own_dir: Path) -> tuple[CgroupRoot | None, str]:
        available = set(_read(str(own_dir / "cgroup.controllers")).split())
        if not {"pids", "memory"} <= available:
            return None, f"cgroup v2 at {own_dir} lacks pids/memory; limits are rlimits only"
        parent = own_dir / PARENT_NAME
        try:
            _write(own_dir / "cgroup.subtree_control", "+pids +memory")
            parent.mkdir(exist_ok=True)
            _write(parent / "cgroup.subtree_control", "+pids +memory")
        except OSError as error:  # e.g. EBUSY: our own cgroup holds processes (v2 forbids it)
            return None, f"cgroup v2 controllers cannot be delegated here ({error}); rlimits only"
        return cls._made({"pids": parent, "memory": parent}, 2)

    @classmethod
    def _made(cls, parents: dict[str, Path], version: int) -> tuple[CgroupRoot | None, str]:
        try:
            for directory in parents.values():
                directory.mkdir(exist_ok=True)
        except OSError as error:
            return None, f"cannot create {directory}: {error}; limits are rlimits only"
        names = ", ".join(sorted(parents))
        return cls(parents, version), f"cgroup v{version} ({names}) per slot"

    def slot(self, uid: int) -> SlotCgroup:
        """Create (or reuse, emptied) the cgroup of slot `uid`."""
        dirs = {name: parent / f"uid-{uid}" for name, parent in self.parents.items()}
        cgroup = SlotCgroup(dirs, self.version)
        cgroup.ensure()
        cgroup.kill_all()
        return cgroup

    def stale_uids(self) -> set[int]:
        """Uids that have a slot directory here (live or left by a crashed service)."""
        uids: set[int] = set()
        for parent in self.parents.values():
            for entry in parent.glob("uid-*"):
                if entry.name[4:].isdigit():
                    uids.add(int(entry.name[4:]))
        return uids

    def remove_parents(self) -> None:
        """Remove the parents if no other service uses them any more (EBUSY otherwise)."""
        for parent in set(self.parents.values()):
            try:
                parent.rmdir()
            except OSError:
                pass


def _write_v1_memory_limit(memory: Path, limit: int) -> None:
    """memory.limit_in_bytes and, where swap is accounted, the same memsw limit (swap may not
    hide a bomb). The kernel keeps memsw >= memory at every write: raise memsw first, lower it
    last."""
    names = ["memory.limit_in_bytes"]
    if (memory / "memory.memsw.limit_in_bytes").exists():
        names.append("memory.memsw.limit_in_bytes")
        if limit > int(_read(str(memory / "memory.limit_in_bytes"))):
            names.reverse()
    for name in names:
        _write(memory / name, limit)


def _write(path: Path, value: object) -> None:
    with open(path, "w") as handle:
        handle.write(str(value))


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def _keyed(text: str) -> dict[str, int]:
    """'key value' lines -> {key: int(value)} (non-integer values are skipped)."""
    result: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            result[key] = int(value)
    return result


def _cgroup_mounts(mountinfo: Path) -> dict[str, Path]:
    """controller -> mount point of its v1 hierarchy; '' -> the v2 mount point."""
    mounts: dict[str, Path] = {}
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, super_options = fields[separator + 1], fields[separator + 3].split(",")
        if fields[3] != "/":  # a cgroup namespace's view; our own path is relative to it
            continue
        if fstype == "cgroup":
            for option in super_options:
                mounts.setdefault(option, Path(fields[4]))
        elif fstype == "cgroup2":
            mounts.setdefault("", Path(fields[4]))
    return mounts


def _own_cgroups(cgroup_file: Path) -> dict[str, str]:
    """controller -> this process's cgroup path; '' -> its v2 path."""
    own: dict[str, str] = {}
    for line in cgroup_file.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own
