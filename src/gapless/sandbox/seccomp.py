"""The syscall filter of every sandboxed program: a classic-BPF seccomp program built here.

`filter_program()` returns the filter as bytes (struct sock_filter[], native byte order). The
host builds it once per server start and passes it in the server's spec; each program installs
it in its start-up (boot.py `_install_filter`: NoNewPrivs, then PR_SET_SECCOMP), after dropping
its capabilities and before its first line, in bwrap and in reduced mode alike. No library is
needed (libseccomp's Python bindings are a Debian package, not a wheel).

What it denies, and why (namespaces do not cover these kernel objects):
- keyrings (`add_key`, `keyctl`, `request_key`): per-uid and per-session, shared with the host
  and with the slot's earlier jobs; each job also starts in a fresh session keyring (boot.py);
- socket families other than AF_UNIX, AF_INET, AF_INET6 (`socket`, `socketpair`): AF_VSOCK
  reaches the hypervisor past the network namespace; netlink, packet, alg, ... are attack surface;
- io_uring (`io_uring_setup/enter/register`): its own path into the kernel, a rich bug source;
- inotify, fanotify and dnotify (`fcntl F_NOTIFY`): watching the shared read-only /usr shows a
  job's file opens to another job;
- file locks (`flock`, `fcntl` F_GETLK/F_SETLK(W)/F_OFD_*/leases): /usr and the /dev nodes are
  the same inodes for every job, so a lock is a signal between concurrent jobs;
- `ptrace`, `process_vm_readv/writev`, `pidfd_getfd`, `kcmp`: another process's memory and fds;
- `bpf`, `userfaultfd`, `perf_event_open`: kernel attack surface and side channels;
- the mount family, `chroot`, `pivot_root`, `unshare`, `setns`: namespace games (also refused
  for lack of capabilities: this is the second wall);
- `init_module`, `finit_module`, `delete_module`, `kexec_load`, `kexec_file_load`, `reboot`,
  `swapon`, `swapoff`, `acct`, `quotactl`, `syslog`, `iopl`, `ioperm`, `uselib`, `vhangup`,
  `lookup_dcookie`, `name_to_handle_at`, `open_by_handle_at`: host administration;
- legacy AIO (`io_setup` and the rest, ENOSYS): its contexts count against fs.aio-max-nr, one
  number for the whole host, which one job could take;
- `memfd_secret` (ENOSYS): memory taken out of the kernel's direct map, for no need of a program;
- page-cache residency, read or set directly, on files every job shares (/usr): `mincore`,
  `cachestat`, `preadv2` (ENOSYS; the C library's `preadv` does not use it; its RWF_NOWAIT
  says whether a page is cached), `process_madvise` (ENOSYS); `fadvise64` and `madvise`'s
  MADV_COLD / MADV_PAGEOUT answer 0 and do nothing (advice may be ignored; DONTNEED would evict
  a shared file's pages). The timing of a read remains: docs/sandbox.md bounds it;
- `sync` answers 0 and does nothing: it would flush every filesystem of the host; the job's
  only writable one is a tmpfs;
- `setrlimit`, and `prlimit64` with a new limit (reading limits stays allowed): the program's
  limits are the sandbox's, set before its first line; `process_mrelease`;
- `clone3` answers ENOSYS (its flags sit in memory a filter cannot read), so the C library
  falls back to `clone`; every syscall of another ABI (x32 on x86_64) is denied.
A denied call fails with an errno (EPERM; EAFNOSUPPORT for a socket family; ENOLCK for a lock;
ENOSYS where a program should take the path of a kernel without the call): programs see an
ordinary error, and nothing is killed.

What the filter allows that the kernel keeps outside every cgroup, and what caps it instead
(the audit; docs/sandbox.md "Kernel-wide resources" has the figures):
- pseudo terminals (kernel.pty.max is host-wide): each server mounts its own devpts instance
  with `max=` (boot.py `MAX_PTYS`); reduced mode has the host's /dev/ptmx;
- TCP/UDP socket buffers (net.ipv4.tcp_mem and udp_mem are host-wide; cgroup v1 charges them
  only under memory.kmem.tcp.limit_in_bytes, which cgroups.py sets; v2 charges them to
  memory.max); AF_UNIX queues, pipes, SysV and POSIX IPC, epoll, eventfd, timerfd, signalfd,
  timers and queued signals are charged to the slot's memory cgroup and counted by
  RLIMIT_NOFILE per process; SO_SNDBUFFORCE/SO_RCVBUFFORCE need CAP_NET_ADMIN, which the
  program lacks; net.core.wmem_max is host-wide and cannot be lowered from the slot's netns;
- per-uid limits (inotify, keys, epoll watches, pipe pages, queued signals, message queues) are
  per slot: each slot has its own uid, and each job its own IPC namespace;
- RLIMIT_MEMLOCK 0 (no mlock: page-cache pages pinned for other jobs), RLIMIT_MSGQUEUE,
  RLIMIT_RTPRIO 0 and RLIMIT_NICE 0 (no real-time or raised priority: the host's CPUs)
  are set explicitly (limits.py), not inherited from the host;
- the OOM killer: the job runs at oom_score_adj 1000 with a floor of 1000 that the host sets
  (boot.py's forker), so inside the slot's memory cgroup it is chosen before the server.

Guaranteed: the filter is inherited by every process and thread the program makes and cannot be
removed. NOT guaranteed: it is a deny-list; every other syscall of the shared kernel remains
reachable, and a kernel bug there escapes. Architectures: x86_64 and aarch64 (others raise
`SandboxError` at start).
"""

from __future__ import annotations

import errno
import platform
import struct

from gapless.sandbox.result import SandboxError

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_KILL_PROCESS = 0x80000000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def _arg(index: int) -> int:
    return 16 + 8 * index  # the low 32 bits of argument `index` (little-endian)


_DENIED = (
    "add_key", "keyctl", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    "flock",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "bpf", "userfaultfd", "perf_event_open",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "iopl", "ioperm", "uselib",
    "vhangup", "lookup_dcookie", "name_to_handle_at", "open_by_handle_at",
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "memfd_secret", "mincore", "cachestat", "preadv2", "process_madvise", "process_mrelease",
    "setrlimit",
)  # fmt: skip
NO_OPS = ("fadvise64", "sync")  # answer 0 without running: advice and a host-wide flush
NO_OP_MADVISE = (20, 21)  # MADV_COLD, MADV_PAGEOUT: advice to evict, answered 0 and ignored
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
DENIED_FCNTL = {  # command -> errno
    5: errno.ENOLCK, 6: errno.ENOLCK, 7: errno.ENOLCK,  # F_GETLK, F_SETLK, F_SETLKW
    36: errno.ENOLCK, 37: errno.ENOLCK, 38: errno.ENOLCK,  # F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
    1024: errno.EPERM, 1025: errno.EPERM, 1026: errno.EPERM,  # F_SETLEASE, F_GETLEASE, F_NOTIFY
}  # fmt: skip
_ERRNO = {
    "flock": errno.ENOLCK,
    **dict.fromkeys(("io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents",
                     "io_pgetevents", "memfd_secret", "mincore", "cachestat", "preadv2",
                     "process_madvise"), errno.ENOSYS),
}  # fmt: skip

# (audit arch, syscall numbers, first number of a foreign ABI or None)
_X86_64 = {
    "add_key": 248, "keyctl": 250, "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254,
    "fanotify_init": 300, "fanotify_mark": 301, "flock": 73, "ptrace": 101, "process_vm_readv": 310,
    "process_vm_writev": 311, "pidfd_getfd": 438, "kcmp": 312, "bpf": 321, "userfaultfd": 323,
    "perf_event_open": 298, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "unshare": 272, "setns": 308, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "syslog": 103, "iopl": 172, "ioperm": 173, "uselib": 134, "vhangup": 153, "lookup_dcookie": 212,
    "name_to_handle_at": 303, "open_by_handle_at": 304,
    "socket": 41, "socketpair": 53, "fcntl": 72, "clone3": 435,
    "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210,
    "io_pgetevents": 333, "memfd_secret": 447, "mincore": 27, "cachestat": 451, "preadv2": 327,
    "process_madvise": 440, "process_mrelease": 448, "setrlimit": 160, "prlimit64": 302,
    "fadvise64": 221, "sync": 162, "madvise": 28,
}  # fmt: skip
_AARCH64 = {
    "add_key": 217, "keyctl": 219, "request_key": 218, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_init": 262,
    "fanotify_mark": 263, "flock": 32, "ptrace": 117, "process_vm_readv": 270,
    "process_vm_writev": 271, "pidfd_getfd": 438, "kcmp": 272, "bpf": 280, "userfaultfd": 282,
    "perf_event_open": 241, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "unshare": 97, "setns": 268, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
    "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "quotactl_fd": 443,
    "syslog": 116, "lookup_dcookie": 18, "name_to_handle_at": 264, "open_by_handle_at": 265,
    "socket": 198, "socketpair": 199, "fcntl": 25, "clone3": 435,
    "io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_cancel": 3, "io_getevents": 4,
    "io_pgetevents": 292, "memfd_secret": 447, "mincore": 232, "cachestat": 451, "preadv2": 286,
    "process_madvise": 440, "process_mrelease": 448, "setrlimit": 164, "prlimit64": 261,
    "fadvise64": 223, "sync": 81, "madvise": 233,
}  # fmt: skip
ARCHES = {"x86_64": (0xC000003E, _X86_64, 0x40000000), "aarch64": (0xC00000B7, _AARCH64, None)}


def syscall_numbers(machine: str | None = None) -> dict[str, int]:
    """Name -> number of the syscalls the filter names, on this (or `machine`'s) architecture."""
    return _arch(machine)[1]


def filter_program(machine: str | None = None) -> bytes:
    """The filter for this host's architecture (or `machine`), as struct sock_filter[]."""
    audit_arch, numbers, foreign_abi = _arch(machine)
    code: list[tuple[int, int, int, int]] = []

    def deny(errno_value: int) -> tuple[int, int, int, int]:
        return (_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno_value)

    code += [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, audit_arch), (_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    code.append((_LD_W_ABS, 0, 0, _NR))
    if foreign_abi is not None:
        code += [(_JGE_K, 0, 1, foreign_abi), deny(errno.EPERM)]
    for name in _DENIED:
        if name in numbers:
            code += [(_JEQ_K, 0, 1, numbers[name]), deny(_ERRNO.get(name, errno.EPERM))]
    code += [(_JEQ_K, 0, 1, numbers["clone3"]), deny(errno.ENOSYS)]
    for name in NO_OPS:
        code += [(_JEQ_K, 0, 1, numbers[name]), deny(0)]
    block = [(_LD_W_ABS, 0, 0, _arg(2))]  # madvise's advice
    for advice in NO_OP_MADVISE:
        block += [(_JEQ_K, 0, 1, advice), deny(0)]
    block.append((_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    code += [(_JEQ_K, 0, len(block), numbers["madvise"]), *block]
    block = [  # prlimit64's new limit (argument 2, a pointer): reading limits stays allowed
        (_LD_W_ABS, 0, 0, _arg(2)), (_JEQ_K, 1, 0, 0), deny(errno.EPERM),
        (_LD_W_ABS, 0, 0, _arg(2) + 4), (_JEQ_K, 1, 0, 0), deny(errno.EPERM),
        (_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]  # fmt: skip
    code += [(_JEQ_K, 0, len(block), numbers["prlimit64"]), *block]
    for name in ("socket", "socketpair"):  # the family is argument 0
        block = [(_LD_W_ABS, 0, 0, _arg(0))]
        for i, family in enumerate(ALLOWED_SOCKET_FAMILIES):
            block.append((_JEQ_K, len(ALLOWED_SOCKET_FAMILIES) - i, 0, family))  # -> allow
        block += [deny(errno.EAFNOSUPPORT), (_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
        code += [(_JEQ_K, 0, len(block), numbers[name]), *block]
    block = [(_LD_W_ABS, 0, 0, _arg(1))]  # fcntl's command
    for command, errno_value in DENIED_FCNTL.items():
        block += [(_JEQ_K, 0, 1, command), deny(errno_value)]
    block.append((_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    code += [(_JEQ_K, 0, len(block), numbers["fcntl"]), *block]
    code.append((_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    if len(code) > 4096:  # BPF_MAXINSNS
        raise AssertionError("seccomp filter too long")
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in code)


def _arch(machine: str | None) -> tuple[int, dict[str, int], int | None]:
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SandboxError(f"the sandbox's syscall filter has no table for {machine!r} (x86_64, aarch64)")
    return ARCHES[machine]
