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
- `clone3` answers ENOSYS (its flags sit in memory a filter cannot read), so the C library
  falls back to `clone`; every syscall of another ABI (x32 on x86_64) is denied.
A denied call fails with an errno (EPERM; EAFNOSUPPORT for a socket family; ENOLCK for a lock;
ENOSYS for clone3): programs see an ordinary error, and nothing is killed.

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
)  # fmt: skip
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
DENIED_FCNTL = {  # command -> errno
    5: errno.ENOLCK, 6: errno.ENOLCK, 7: errno.ENOLCK,  # F_GETLK, F_SETLK, F_SETLKW
    36: errno.ENOLCK, 37: errno.ENOLCK, 38: errno.ENOLCK,  # F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
    1024: errno.EPERM, 1025: errno.EPERM, 1026: errno.EPERM,  # F_SETLEASE, F_GETLEASE, F_NOTIFY
}  # fmt: skip
_ERRNO = {"flock": errno.ENOLCK}

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
