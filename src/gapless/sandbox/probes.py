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
    # a harness probe: scored by a caller above the sandbox (envs/code/probes.py), (status, stdout)
    runner: Callable[[BwrapSandbox, Probe], tuple[str, str]] | None = None

    @property
    def is_harness(self) -> bool:
        return self.runner is not None


def _probe(name: str, code: str, *expect: str, limits: SandboxLimits = QUICK,
           check: Callable[[str], bool] = lambda stdout: True, uses_bait: bool = False,
           uses_syscalls: bool = False, needs_cgroup: bool = False) -> Probe:  # fmt: skip
    code = (BAIT if uses_bait else "") + (SYSCALLS if uses_syscalls else "") + textwrap.dedent(code)
    return Probe(name, code, frozenset(expect), limits, check, needs_cgroup=needs_cgroup)


def all_failed(stdout: str) -> bool:
    """Each line of the probe's output is `<target>: <outcome>`; none may say `REACHED`."""
    return bool(stdout.strip()) and "REACHED" not in stdout


SYSCALLS = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
            f"nr = {syscall_numbers()!r}\n")  # the host's numbers, for raw syscall probes
# beside main: /work/job in bwrap mode, a host directory in reduced mode
BAIT = "import json, os; bait = json.load(open(os.path.join(os.path.dirname(__file__), 'bait.json')))\n"
PROBES: tuple[Probe, ...] = (
    _probe("infinite loop", "while True:\n    pass\n", "timeout", limits=SandboxLimits(timeout_s=1.0)),
    _probe("busy threads", """
        import threading
        def spin():
            while True:
                pass
        for _ in range(8):
            threading.Thread(target=spin, daemon=True).start()
        threading.Event().wait()
    """, "timeout", limits=SandboxLimits(timeout_s=3.0, cpu_s=1)),
    _probe("sleep past the deadline", "import time\ntime.sleep(60)\n", "timeout",
           limits=SandboxLimits(timeout_s=1.0)),
    _probe("memory bomb", "block = bytearray(8 << 30)\n", "memory_limit"),
    _probe("memory bomb over processes", """
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                block = bytearray(100 << 20)  # pages touched: it is zero-filled
                time.sleep(1)
                os._exit(0)
        for _ in range(4):
            os.wait()
    """, "memory_limit", limits=SandboxLimits(timeout_s=5.0, memory_mb=128), needs_cgroup=True),
    _probe("fork bomb", "import os\nwhile True:\n    os.fork()\n", "process_limit"),
    _probe("a million small files", """
        for i in range(1_000_000):
            open(f"f{i}", "w").close()  # relative: cwd is /tmp (a scratch dir in reduced mode)
    """, "inode_limit"),
    _probe("a 10 GB file", """
        chunk = b"x" * (1 << 20)
        with open("big", "wb") as big:
            for _ in range(10 << 10):
                big.write(chunk)
    """, "disk_limit"),
    _probe("a 10 GB sparse file", "open('sparse', 'wb').truncate(10 << 30)\n", "disk_limit"),
    _probe("tmpfs filled with 1 MB files", """
        for i in range(1000):
            open(f"m{i}", "wb").write(b"x" * (1 << 20))
    """, "disk_limit"),
    _probe("output flood", "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
           "output_limit"),
    _probe("TCP to the host", """
        import socket
        for host in ("127.0.0.1", "10.0.2.2", "192.0.2.1"):
            try:
                socket.create_connection((host, bait["tcp_port"]), timeout=1)
                print(host, "REACHED")
            except OSError as error:
                print(host, type(error).__name__)
    """, "ok", check=all_failed, uses_bait=True),
    _probe("UDP to the host", """
        import socket
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.sendto(b"hello", ("127.0.0.1", bait["udp_port"]))
            print("sent (into the sandbox's own loopback)")
        except OSError as error:
            print(type(error).__name__)
    """, "ok", uses_bait=True),
    _probe("unix sockets to the host", """
        import socket
        for address in (bait["unix_path"], "\\0" + bait["abstract_name"], "/run/systemd/private"):
            try:
                socket.socket(socket.AF_UNIX).connect(address)
                print(repr(address), "REACHED")
            except OSError as error:
                print(repr(address), type(error).__name__)
    """, "ok", check=all_failed, uses_bait=True),
    _probe("read /etc/shadow and the host home", """
        import os
        for path in ("/etc/shadow", "/etc/passwd", bait["secret_path"], "/root", "/home"):
            try:
                if os.path.isdir(path):
                    print(path, "REACHED", os.listdir(path))
                else:
                    print(path, "REACHED", open(path).read(20))
            except OSError as error:
                print(path, type(error).__name__)
    """, "ok", check=all_failed, uses_bait=True),
    _probe("write outside the work dir", """
        import os
        for path in ("/usr/x", "/work/job/x", "/work/job/main.py", "/x", "/dev/x", "/etc/x",
                     bait["outside_path"], "/proc/sys/kernel/hostname"):
            try:
                with open(path, "w") as handle:
                    handle.write("x")
                print(path, "REACHED")
            except OSError as error:
                print(path, type(error).__name__)
    """, "ok", check=all_failed, uses_bait=True),
    _probe("remount and mount", """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        for target, fstype, flags in ((b"/work/job", None, MS_REMOUNT | MS_BIND),
                                      (b"/tmp", b"tmpfs", 0), (b"/usr", None, MS_REMOUNT)):
            result = libc.mount(b"none", target, fstype, flags, None)
            print(target.decode(), "REACHED" if result == 0 else ctypes.get_errno())
    """, "ok", check=all_failed),
    _probe("daemon that outlives the program", """
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
    """, "ok"),
    _probe("user namespace", """
        import ctypes, subprocess
        print("unshare:", "REACHED" if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0
              else ctypes.get_errno())
        done = subprocess.run(["unshare", "-U", "true"], capture_output=True)
        print("unshare -U:", "REACHED" if done.returncode == 0 else done.returncode)
    """, "ok", check=all_failed),
    _probe("signal and trace the sandbox's own processes", """
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
    """, "ok", check=lambda stdout: all_failed(stdout) and stdout.endswith("alive\n")),
    _probe("keyrings of the host and of earlier jobs", """
        session = libc.syscall(nr["keyctl"], 0, -3, 0)  # KEYCTL_GET_KEYRING_ID, session keyring
        user = libc.syscall(nr["keyctl"], 0, -4, 0)  # ... the uid's user keyring
        added = libc.syscall(nr["add_key"], b"user", b"gapless-probe", b"x", 1, -4)
        asked = libc.syscall(nr["request_key"], b"user", bait["key_name"].encode(), None, 0)
        for name, result in (("session", session), ("user", user), ("add_key", added), ("request_key", asked)):
            print(name, "REACHED" if result >= 0 else ctypes.get_errno())
        with open("/proc/keys") as keys:
            text = keys.read()
        print("/proc/keys", "REACHED" if bait["key_name"] in text or "gapless-probe" in text else "no bait")
    """, "ok", check=all_failed, uses_bait=True, uses_syscalls=True),
    _probe("socket families past the network namespace", """
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
    """, "ok", check=lambda stdout: all_failed(stdout) and "allowed families open" in stdout),
    _probe("io_uring, inotify, fanotify and dnotify", """
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
    """, "ok", check=all_failed, uses_syscalls=True),
    _probe("file locks on files every job shares", """
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
    """, "ok", check=all_failed),
    _probe("ptrace/bpf/perf/uffd/mount/module/kexec", """
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
    """, "ok", check=lambda stdout: all_failed(stdout) and all(
        line.split()[-1] == "1" for line in stdout.splitlines()), uses_syscalls=True),  # EPERM: the filter's
    _probe("the host's cgroup path", """
        with open("/proc/self/cgroup") as cgroups:
            text = cgroups.read()
        print("REACHED" if "gapless-sandbox" in text or ".slice" in text else "hidden", text.count("\\n"))
    """, "ok", check=all_failed),
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
        if probe.is_harness:
            status, stdout = probe.runner(sandbox, probe)
        else:
            files = {"main.py": probe.code, "bait.json": json.dumps(bait.params())}
            result = sandbox.run_python(files, "main.py", limits=probe.limits)
            status, stdout = result.status.value, result.stdout
        wall_s = time.monotonic() - start_s
        dirty = bait.reached() + sandbox.leftovers()
    is_expected = status in probe.expect and probe.check(stdout)
    detail = "" if is_expected else f"got {status}, output {stdout[-300:]!r}"
    if dirty:
        detail = "; ".join(filter(None, [detail, *dirty]))
    return ProbeOutcome(probe.name, sandbox.path, status, is_expected, not dirty, detail, wall_s)


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
