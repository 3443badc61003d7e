"""Hostile probes: programs that attack the sandbox, what each must end as, and a clean-host check.

`gapless sandbox check` runs them on this host and prints a table; the test suite runs the same
table (tests/unit/test_sandbox_hostile.py), so what the command reports is what CI asserts.

A probe is one hostile behaviour: its program, the statuses it may end with, a check of its
output, and its limits. Harness probes (envs/code/probes.py) are completions of a tiny code
problem, scored by the code environment through the probe's `runner`, for attacks on the test
harness itself; this module runs them with the same traps. `HostBait` sets the
host-side traps (TCP, UDP, unix path and abstract sockets on 127.0.0.1 / this host, a secret file
in the host home, a directory outside the sandbox) and says afterwards whether anything reached
them. The host is clean after a probe when nothing reached a trap, the sandbox reports no
leftover (`leftovers()`: no process of a finished run), the host's mounts are unchanged and no
job file is left in the host's temp dir.

Guaranteed: every probe is bounded in time by its limits and in size by construction, and writes
only relative to its cwd (the job's tmpfs; in reduced mode a host scratch directory that is
removed after the run), so even a host without isolation is not littered by the check itself.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gapless.sandbox.bwrap import BwrapSandbox
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.seccomp import syscall_numbers

QUICK = SandboxLimits(timeout_s=3.0)
REFUSED = "refused"  # a harness probe in reduced mode: the code environment will not start
SCRATCH_PREFIX = "gapless-reduced-"  # what this package may leave in the host temp dir (worker.py)


@dataclass(frozen=True)
class Probe:
    name: str
    code: str  # the program (main.py; bait.json beside it), or a harness completion
    expect: frozenset[str]  # statuses it may end with (sandbox statuses, or the env's)
    limits: SandboxLimits = QUICK
    check: Callable[[str], bool] = field(default=lambda stdout: True)  # on its stdout
    needs_cgroup: bool = False  # only a run-wide limit (the slot's cgroup) can stop it
    then: str = ""  # a second program, run right after: `check` reads its output instead
    setup: Callable[[], None] | None = None  # on the host, before the program
    keeps_server: bool = False  # warm path: the slot's server must serve the next job itself
    # a harness probe: scored by a caller above the sandbox (envs/code/probes.py), (status, stdout)
    runner: Callable[[BwrapSandbox, Probe], tuple[str, str]] | None = None

    @property
    def is_harness(self) -> bool:
        return self.runner is not None


def _probe(name: str, code: str, *expect: str, limits: SandboxLimits = QUICK,
           check: Callable[[str], bool] = lambda stdout: True, uses_bait: bool = False,
           uses_syscalls: bool = False, needs_cgroup: bool = False, then: str = "",
           setup: Callable[[], None] | None = None, keeps_server: bool = False) -> Probe:  # fmt: skip
    code = (BAIT if uses_bait else "") + (SYSCALLS if uses_syscalls else "") + textwrap.dedent(code)
    return Probe(name, code, frozenset(expect), limits, check, needs_cgroup=needs_cgroup,
                 then=textwrap.dedent(then), setup=setup, keeps_server=keeps_server)  # fmt: skip


def all_failed(stdout: str) -> bool:
    """Each line of the probe's output is `<target>: <outcome>`; none may say `REACHED`."""
    return bool(stdout.strip()) and "REACHED" not in stdout


CACHE_LIST = """
import os, random
FILES = []
for directory, _, names in os.walk("/usr/share"):
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.islink(path) and os.path.isfile(path) and os.path.getsize(path) >= 8192:
            FILES.append(path)
FILES.sort()
FILES = random.Random(51).sample(FILES, min(256, len(FILES)))
"""  # the page-cache probe's files of the shared /usr: the same list on the host and inside
CACHE_BITS = random.Random(52).choices((0, 1), k=256)  # what the first job sends


def _evict_cache_files() -> None:
    """Make the probe's files cold (the host may: it is root or owns the page cache it read)."""
    namespace: dict[str, list[str]] = {}
    exec(CACHE_LIST, namespace)
    for path in namespace["FILES"]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cache_channel_closed(stdout: str) -> bool:
    """The second job's read times, one per file: the best threshold between fast (warm) and
    slow (cold) must not decode the first job's bits much better than a coin (256 bits)."""
    try:
        times = [float(value) for value in stdout.split()]
    except ValueError:
        return False
    bits = CACHE_BITS[: len(times)]
    if len(times) < 64:
        return False
    best = max(sum((t <= cut) == bool(bit) for t, bit in zip(times, bits)) for cut in times)
    return best / len(times) < 0.7


SYSCALLS = (
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
    f"nr = {syscall_numbers()!r}\n"
)  # the host's numbers, for raw syscall probes
# beside main: /work/job in bwrap mode, a host directory in reduced mode
BAIT = "import json, os; bait = json.load(open(os.path.join(os.path.dirname(__file__), 'bait.json')))\n"
PROBES: tuple[Probe, ...] = (
    _probe("infinite loop", "while True:\n    pass\n", "timeout", limits=SandboxLimits(timeout_s=1.0)),
    _probe(
        "busy threads",
        """
        import threading
        def spin():
            while True:
                pass
        for _ in range(8):
            threading.Thread(target=spin, daemon=True).start()
        threading.Event().wait()
    """,
        "timeout",
        limits=SandboxLimits(timeout_s=3.0, cpu_s=1),
    ),
    _probe("sleep past the deadline", "import time\ntime.sleep(60)\n", "timeout", limits=SandboxLimits(timeout_s=1.0)),
    _probe("memory bomb", "block = bytearray(8 << 30)\n", "memory_limit"),
    _probe(
        "memory bomb over processes",
        """
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                block = bytearray(100 << 20)  # pages touched: it is zero-filled
                time.sleep(1)
                os._exit(0)
        for _ in range(4):
            os.wait()
    """,
        "memory_limit",
        limits=SandboxLimits(timeout_s=5.0, memory_mb=128),
        needs_cgroup=True,
    ),
    _probe("fork bomb", "import os\nwhile True:\n    os.fork()\n", "process_limit"),
    _probe(
        "a million small files",
        """
        for i in range(1_000_000):
            open(f"f{i}", "w").close()  # relative: cwd is /tmp (a scratch dir in reduced mode)
    """,
        "inode_limit",
    ),
    _probe(
        "a 10 GB file",
        """
        chunk = b"x" * (1 << 20)
        with open("big", "wb") as big:
            for _ in range(10 << 10):
                big.write(chunk)
    """,
        "disk_limit",
    ),
    _probe("a 10 GB sparse file", "open('sparse', 'wb').truncate(10 << 30)\n", "disk_limit"),
    _probe(
        "tmpfs filled with 1 MB files",
        """
        for i in range(1000):
            open(f"m{i}", "wb").write(b"x" * (1 << 20))
    """,
        "disk_limit",
    ),
    _probe("output flood", "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n", "output_limit"),
    _probe(
        "TCP to the host",
        """
        import socket
        for host in ("127.0.0.1", "10.0.2.2", "192.0.2.1"):
            try:
                socket.create_connection((host, bait["tcp_port"]), timeout=1)
                print(host, "REACHED")
            except OSError as error:
                print(host, type(error).__name__)
    """,
        "ok",
        check=all_failed,
        uses_bait=True,
    ),
    _probe(
        "UDP to the host",
        """
        import socket
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.sendto(b"hello", ("127.0.0.1", bait["udp_port"]))
            print("sent (into the sandbox's own loopback)")
        except OSError as error:
            print(type(error).__name__)
    """,
        "ok",
        uses_bait=True,
    ),
    _probe(
        "unix sockets to the host",
        """
        import socket
        for address in (bait["unix_path"], "\\0" + bait["abstract_name"], "/run/systemd/private"):
            try:
                socket.socket(socket.AF_UNIX).connect(address)
                print(repr(address), "REACHED")
            except OSError as error:
                print(repr(address), type(error).__name__)
    """,
        "ok",
        check=all_failed,
        uses_bait=True,
    ),
    _probe(
        "read /etc/shadow and the host home",
        """
        import os
        for path in ("/etc/shadow", "/etc/passwd", bait["secret_path"], "/root", "/home"):
            try:
                if os.path.isdir(path):
                    print(path, "REACHED", os.listdir(path))
                else:
                    print(path, "REACHED", open(path).read(20))
            except OSError as error:
                print(path, type(error).__name__)
    """,
        "ok",
        check=all_failed,
        uses_bait=True,
    ),
    _probe(
        "write outside the work dir",
        """
        import os
        for path in ("/usr/x", "/work/job/x", "/work/job/main.py", "/x", "/dev/x", "/etc/x",
                     bait["outside_path"], "/proc/sys/kernel/hostname"):
            try:
                with open(path, "w") as handle:
                    handle.write("x")
                print(path, "REACHED")
            except OSError as error:
                print(path, type(error).__name__)
    """,
        "ok",
        check=all_failed,
        uses_bait=True,
    ),
    _probe(
        "remount and mount",
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        for target, fstype, flags in ((b"/work/job", None, MS_REMOUNT | MS_BIND),
                                      (b"/tmp", b"tmpfs", 0), (b"/usr", None, MS_REMOUNT)):
            result = libc.mount(b"none", target, fstype, flags, None)
            print(target.decode(), "REACHED" if result == 0 else ctypes.get_errno())
    """,
        "ok",
        check=all_failed,
    ),
    _probe(
        "daemon that outlives the program",
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                for fd in (0, 1, 2):
                    os.close(fd)
                time.sleep(60)
            os._exit(0)
        time.sleep(0.2)
        print("parent done")
    """,
        "ok",
    ),
    _probe(
        "user namespace",
        """
        import ctypes, subprocess
        print("unshare:", "REACHED" if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0
              else ctypes.get_errno())
        done = subprocess.run(["unshare", "-U", "true"], capture_output=True)
        print("unshare -U:", "REACHED" if done.returncode == 0 else done.returncode)
    """,
        "ok",
        check=all_failed,
    ),
    _probe(
        "signal and trace the sandbox's own processes",
        """
        import ctypes, os, signal
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            os.kill(1, sig)  # init of the job: the kernel drops these, it must survive
        print("ptrace", "REACHED" if ctypes.CDLL(None, use_errno=True).ptrace(16, 1, 0, 0) == 0
              else "refused")
        for path in ("/proc/1/mem", "/proc/1/fd/4", "/proc/1/root/work"):
            try:
                open(path, "rb").read(1)
                print(path, "REACHED")
            except OSError as error:
                print(path, type(error).__name__)
        print("alive")
    """,
        "ok",
        check=lambda stdout: all_failed(stdout) and stdout.endswith("alive\n"),
    ),
    _probe(
        "keyrings of the host and of earlier jobs",
        """
        session = libc.syscall(nr["keyctl"], 0, -3, 0)  # KEYCTL_GET_KEYRING_ID, session keyring
        user = libc.syscall(nr["keyctl"], 0, -4, 0)  # ... the uid's user keyring
        added = libc.syscall(nr["add_key"], b"user", b"gapless-probe", b"x", 1, -4)
        asked = libc.syscall(nr["request_key"], b"user", bait["key_name"].encode(), None, 0)
        for name, result in (("session", session), ("user", user), ("add_key", added), ("request_key", asked)):
            print(name, "REACHED" if result >= 0 else ctypes.get_errno())
        with open("/proc/keys") as keys:
            text = keys.read()
        print("/proc/keys", "REACHED" if bait["key_name"] in text or "gapless-probe" in text else "no bait")
    """,
        "ok",
        check=all_failed,
        uses_bait=True,
        uses_syscalls=True,
    ),
    _probe(
        "socket families past the network namespace",
        """
        import socket
        for family in (40, 16, 17, 38, 15, 31):  # VSOCK, NETLINK, PACKET, ALG, KEY, BLUETOOTH
            try:
                socket.socket(family, socket.SOCK_DGRAM).close()
                print(family, "REACHED")
            except OSError as error:
                print(family, error.errno)
        for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
            socket.socket(family, socket.SOCK_STREAM).close()  # the three allowed ones work
        print("allowed families open")
    """,
        "ok",
        check=lambda stdout: all_failed(stdout) and "allowed families open" in stdout,
    ),
    _probe(
        "io_uring, inotify, fanotify and dnotify",
        """
        import fcntl, os
        params = ctypes.create_string_buffer(120)
        for name, args in (("io_uring_setup", (4, params)), ("inotify_init1", (0,)),
                           ("fanotify_init", (0, 0))):
            result = libc.syscall(nr[name], *args)
            print(name, "REACHED" if result >= 0 else ctypes.get_errno())
        usr = os.open("/usr/lib", os.O_RDONLY)
        try:
            fcntl.fcntl(usr, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)
            print("dnotify REACHED")
        except OSError as error:
            print("dnotify", error.errno)
    """,
        "ok",
        check=all_failed,
        uses_syscalls=True,
    ),
    _probe(
        "file locks on files every job shares",
        """
        import fcntl, os
        for path, mode in (("/usr/bin/python3", os.O_RDONLY), ("/dev/null", os.O_WRONLY)):
            fd = os.open(path, mode)
            for name, lock in (("flock", lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)),
                               ("lockf", lambda: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)),
                               ("getlk", lambda: fcntl.fcntl(fd, fcntl.F_GETLK, bytes(32)))):
                try:
                    lock()
                    print(path, name, "REACHED")
                except OSError as error:
                    print(path, name, error.errno)
    """,
        "ok",
        check=all_failed,
    ),
    _probe(
        "ptrace/bpf/perf/uffd/mount/module/kexec",
        """
        calls = {"ptrace": (16, 1, 0, 0), "bpf": (0, None, 0), "perf_event_open": (None, 0, -1, -1, 0),
                 "userfaultfd": (0,), "mount": (b"none", b"/tmp", b"tmpfs", 0, None),
                 "umount2": (b"/tmp", 2), "fsopen": (b"tmpfs", 0), "open_tree": (-100, b"/tmp", 1),
                 "unshare": (0x20000,), "setns": (0, 0), "init_module": (None, 0, b""),
                 "finit_module": (0, b"", 0), "delete_module": (b"x", 0),
                 "kexec_load": (0, 0, None, 0), "process_vm_readv": (1, None, 0, None, 0, 0),
                 "kcmp": (1, 1, 0, 0, 0), "pidfd_getfd": (0, 0, 0)}
        for name, args in calls.items():
            result = libc.syscall(nr[name], *args)
            print(name, "REACHED" if result >= 0 else ctypes.get_errno())
    """,
        "ok",
        check=lambda stdout: all_failed(stdout) and all(line.split()[-1] == "1" for line in stdout.splitlines()),
        uses_syscalls=True,
    ),  # EPERM: the filter's
    _probe(
        "the host's cgroup path",
        """
        with open("/proc/self/cgroup") as cgroups:
            text = cgroups.read()
        print("REACHED" if "gapless-sandbox" in text or ".slice" in text else "hidden", text.count("\\n"))
    """,
        "ok",
        check=all_failed,
    ),
    _probe(
        "legacy AIO contexts",
        """
        context = ctypes.c_ulong(0)
        result = libc.syscall(nr["io_setup"], 65536, ctypes.byref(context))  # fs.aio-max-nr: host-wide
        print("io_setup", "REACHED" if result >= 0 else ctypes.get_errno())
    """,
        "ok",
        check=all_failed,
        uses_syscalls=True,
    ),
    _probe(
        "pseudo terminals past the slot's cap",
        """
        import pty
        terminals = []
        try:
            for _ in range(200):
                terminals.append(pty.openpty())
        except OSError as error:
            print("stopped", error.errno)
        print("ptys", len(terminals), "REACHED" if len(terminals) > 8 else "capped")
    """,
        "ok",
        check=lambda stdout: all_failed(stdout) and "stopped" in stdout,
    ),
    _probe(
        "TCP buffers past the memory limit",
        """
        import socket, time
        queued, sockets, deadline = 0, [], time.monotonic() + 3
        while time.monotonic() < deadline and len(sockets) < 150:
            listener = socket.create_server(("127.0.0.1", 0))
            sender = socket.create_connection(listener.getsockname())
            receiver = listener.accept()[0]
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 26)
            receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 26)
            sender.setblocking(False)
            while time.monotonic() < deadline:
                try:
                    queued += sender.send(b"x" * 65536)
                except BlockingIOError:
                    break
            sockets += [listener, sender, receiver]
        # the run's memory cgroup is 256 MiB; its sockets may hold at most 64 MiB of it again
        print("queued MiB", queued >> 20, "REACHED" if queued > 128 << 20 else "capped")
    """,
        "ok",
        check=all_failed,
        limits=SandboxLimits(timeout_s=6.0, memory_mb=128),
        needs_cgroup=True,
    ),
    _probe(
        "unix socket queues past the memory limit",
        """
        import socket
        queued, pairs = 0, []
        for _ in range(100):
            sender, receiver = socket.socketpair()
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 26)
            sender.setblocking(False)
            while True:
                try:
                    queued += sender.send(b"x" * 65536)
                except BlockingIOError:
                    break
            pairs.append((sender, receiver))
        print("queued MiB", queued >> 20, "REACHED" if queued > 256 << 20 else "capped")
    """,
        "ok",
        "memory_limit",
        check=lambda stdout: "REACHED" not in stdout,
        limits=SandboxLimits(timeout_s=6.0, memory_mb=128),
        needs_cgroup=True,
    ),
    _probe(
        "slot server under the job's memory pressure",
        """
        import os, time
        for target in ("/proc/self/oom_score_adj", "/proc/1/oom_score_adj"):
            try:  # lowered, as far as the kernel lets it (to the floor)
                open(target, "w").write("0")
            except OSError:
                pass
        for i in range(4):  # the tmpfs's pages count in the memory cgroup, and in nobody's RSS
            open(f"fill{i}", "wb").write(b"x" * (15 << 20))
        children = []
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                block = bytearray(16 << 20)
                time.sleep(2)
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        print("the whole bomb fitted: REACHED")
    """,
        "memory_limit",
        limits=SandboxLimits(timeout_s=4.0, memory_mb=256, max_processes=64),
        needs_cgroup=True,
        keeps_server=True,
    ),
    _probe(
        "page-cache residency calls",
        """
        import mmap, os
        fd = os.open("/usr/bin/python3", os.O_RDONLY)
        view = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        buffer = ctypes.create_string_buffer(4096)
        vector = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), 4096)
        for name, args in (("mincore", (ctypes.c_void_p(address), 4096, buffer)),
                           ("cachestat", (fd, buffer, buffer, 0)),
                           ("preadv2", (fd, vector, 1, 0, 0, 8))):  # RWF_NOWAIT
            result = libc.syscall(nr[name], *args)
            print(name, "REACHED" if result >= 0 else ctypes.get_errno())
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # answered 0, and ignored
        view.madvise(21)  # MADV_PAGEOUT
        print("advice accepted")
    """,
        "ok",
        check=lambda stdout: all_failed(stdout) and "advice accepted" in stdout,
        uses_syscalls=True,
    ),
    _probe(
        "page cache between consecutive jobs",
        CACHE_LIST
        + f"BITS = {CACHE_BITS!r}\n"
        + textwrap.dedent("""
        for path, bit in zip(FILES, BITS):  # a cold file read is a 1, left cold a 0
            if bit:
                with open(path, "rb") as handle:
                    handle.read(4096)
        print("sent", len(FILES))
    """),
        "ok",
        then=CACHE_LIST
        + textwrap.dedent("""
        import time
        times = []
        for path in FILES:
            with open(path, "rb") as handle:
                start = time.perf_counter()
                handle.read(4096)
                times.append(time.perf_counter() - start)
        print(*times)
    """),
        check=_cache_channel_closed,
        setup=_evict_cache_files,
        needs_cgroup=True,
    ),
    _probe(
        "lower the program's own limits",
        """
        import resource
        for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NOFILE"):
            kind = getattr(resource, name)
            soft, hard = resource.getrlimit(kind)  # reading them stays allowed
            try:
                resource.setrlimit(kind, (min(soft, 1), min(hard, 1)) if name != "RLIMIT_NOFILE" else (16, 16))
                print(name, "REACHED")
            except (OSError, ValueError) as error:
                print(name, type(error).__name__)
    """,
        "ok",
        check=all_failed,
    ),
    _probe(
        "mlock, memfd_secret, real-time priority",
        """
        import os
        buffer = ctypes.create_string_buffer(4096)
        print("mlock", "REACHED" if libc.mlock(buffer, 4096) == 0 else ctypes.get_errno())
        print("memfd_secret", "REACHED" if libc.syscall(nr["memfd_secret"], 0) >= 0 else ctypes.get_errno())
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            print("SCHED_FIFO REACHED")
        except OSError as error:
            print("SCHED_FIFO", error.errno)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -5)
            print("nice -5 REACHED")
        except OSError as error:
            print("nice -5", error.errno)
        os.sync()  # answered at once, flushing nothing
        print("sync returned")
    """,
        "ok",
        check=lambda stdout: all_failed(stdout) and "sync returned" in stdout,
        uses_syscalls=True,
    ),
)


@dataclass
class ProbeOutcome:
    name: str
    path: str
    status: str
    is_expected: bool
    is_host_clean: bool
    detail: str  # why not, when either check failed
    wall_s: float


class HostBait:
    """Host-side traps for one probe; `reached()` lists what a program got to."""

    def __enter__(self) -> HostBait:
        self.dir = Path(tempfile.mkdtemp(prefix="gapless-bait-"))
        self.tcp = _listening(socket.socket(), ("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.unix = _listening(socket.socket(socket.AF_UNIX), str(self.dir / "socket"))
        self.abstract_name = f"gapless-bait-{os.getpid()}-{time.monotonic_ns()}"
        self.abstract = _listening(socket.socket(socket.AF_UNIX), "\0" + self.abstract_name)
        self.secret = Path.home() / f".gapless-bait-secret-{os.getpid()}"
        self.secret.write_text("bait")
        self.outside = self.dir / "written-by-the-sandbox"
        self.key_name = f"gapless-bait-{os.getpid()}-{time.monotonic_ns()}"
        self.key = _add_host_key(self.key_name)
        self.mounts = _mount_points()
        self.temp_entries = _gapless_temp_entries()
        return self

    def params(self) -> dict[str, object]:
        return {
            "tcp_port": self.tcp.getsockname()[1],
            "udp_port": self.udp.getsockname()[1],
            "unix_path": str(self.dir / "socket"),
            "abstract_name": self.abstract_name,
            "secret_path": str(self.secret),
            "outside_path": str(self.outside),
            "key_name": self.key_name,
        }

    def reached(self) -> list[str]:
        found = []
        for name, listener in (("tcp", self.tcp), ("unix", self.unix), ("abstract", self.abstract)):
            try:
                listener.accept()[0].close()
                found.append(f"{name} listener got a connection")
            except BlockingIOError:
                pass
        try:
            self.udp.recv(64)
            found.append("udp socket got a datagram")
        except BlockingIOError:
            pass
        if self.outside.exists():
            found.append(f"{self.outside} was written")
        if self.secret.read_text() != "bait":
            found.append("the secret in the host home changed")
        if self.key is not None and _key_payload(self.key) != b"bait":
            found.append("the host's bait key changed or was revoked")
        if _mount_points() != self.mounts:
            found.append(f"host mounts changed: {sorted(_mount_points() ^ self.mounts)}")
        new_entries = _gapless_temp_entries() - self.temp_entries - {self.dir.name}
        if new_entries:
            found.append(f"left in the host temp dir: {sorted(new_entries)}")
        return found

    def __exit__(self, *exc: object) -> None:
        for listener in (self.tcp, self.udp, self.unix, self.abstract):
            listener.close()
        self.secret.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.key is not None:
            _keyctl(KEYCTL_REVOKE, self.key)


def run_probe(sandbox: BwrapSandbox, probe: Probe) -> ProbeOutcome:
    """Run one probe with fresh traps; the outcome says whether it ended as expected and
    whether the host stayed clean."""
    with HostBait() as bait:
        start_s = time.monotonic()
        if probe.is_harness and sandbox.mode == "reduced":  # code tasks refuse to start there
            return ProbeOutcome(probe.name, sandbox.path, REFUSED, True, True, "", 0.0)
        restarts = sandbox.metrics()["sandbox/slot_restarts_total"]
        if probe.setup is not None:
            probe.setup()
        if probe.is_harness:
            status, stdout = probe.runner(sandbox, probe)
        else:
            files = {"main.py": probe.code, "bait.json": json.dumps(bait.params())}
            result = sandbox.run_python(files, "main.py", limits=probe.limits)
            status, stdout = result.status.value, result.stdout
        wall_s = time.monotonic() - start_s
        if probe.then:
            stdout = sandbox.run_python({"main.py": probe.then}, "main.py", limits=probe.limits).stdout
        dirty = bait.reached() + sandbox.leftovers()
        if probe.keeps_server:
            dirty += _server_lost(sandbox, restarts)
    is_expected = status in probe.expect and probe.check(stdout)
    detail = "" if is_expected else f"got {status}, output {stdout[-300:]!r}"
    if dirty:
        detail = "; ".join(filter(None, [detail, *dirty]))
    return ProbeOutcome(probe.name, sandbox.path, status, is_expected, not dirty, detail, wall_s)


def _server_lost(sandbox: BwrapSandbox, restarts_before: float) -> list[str]:
    """After a probe that must not reach the slot's server: the next job runs, and on the warm
    path on the same server (no slot restart since the probe began)."""
    after = sandbox.run_python({"main.py": "print('next')\n"}, "main.py", limits=QUICK)
    lost = [] if after.stdout == "next\n" else [f"the next job ended {after.status.value}"]
    if sandbox.path == "warm" and sandbox.metrics()["sandbox/slot_restarts_total"] != restarts_before:
        lost.append("the slot's server was restarted")
    return lost


KEYCTL_REVOKE, KEYCTL_READ, KEY_SPEC_SESSION_KEYRING = 3, 11, -3


def _keyctl(*args: object) -> int:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(syscall_numbers()["keyctl"], *args)


def _add_host_key(name: str) -> int | None:
    """A key in this process's session keyring, as a secret a job must not reach (None: the
    kernel has no keyrings for us)."""
    import ctypes

    number = syscall_numbers()["add_key"]
    key = ctypes.CDLL(None, use_errno=True).syscall(number, b"user", name.encode(), b"bait", 4,
                                                    KEY_SPEC_SESSION_KEYRING)  # fmt: skip
    return key if key >= 0 else None


def _key_payload(key: int) -> bytes:
    import ctypes

    buffer = ctypes.create_string_buffer(16)
    size = _keyctl(KEYCTL_READ, key, buffer, 16)
    return buffer.raw[:size] if size >= 0 else b""


def _listening(listener: socket.socket, address: object) -> socket.socket:
    listener.bind(address)
    listener.listen()
    listener.setblocking(False)
    return listener


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        return {line.split()[4] for line in mountinfo}


def _gapless_temp_entries() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(SCRATCH_PREFIX)}
