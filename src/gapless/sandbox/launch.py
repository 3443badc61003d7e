"""Starting a slot's server process: the bwrap command line, or the bare one of reduced mode.

`spawn_server` starts `python -I -B -c <boot.py> <spec>` as the slot's host uid (when we are
root), inside bubblewrap when `isolate` is true, and returns without waiting; the caller then
waits for the server's `ready` message on the control socket.

The bwrap options, and why each is there, are listed in bwrap.py's docstring. In short: every
namespace unshared (the network one leaves loopback only), a nested user namespace forbidden,
every capability dropped except CAP_SYS_ADMIN *of the slot's own user namespace*, which the
server needs to give each job fresh pid, mount and IPC namespaces and capped tmpfs mounts (the
program drops it before its first line). Read-only /usr and its links, fresh /proc and /dev, a
read-only root with empty mount points; no /etc, no home, no host /tmp, no repository.
"""

from __future__ import annotations

import marshal
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gapless.sandbox import cow
from gapless.sandbox.cow import SessionBase

BOOT_SOURCE = Path(__file__).with_name("boot.py").read_text(encoding="utf-8")
# Dropping to the slot uid through setpriv lets Popen use vfork: a fork of a large host process
# (a trainer holding a model) costs milliseconds of page-table copying per job.
SETPRIV = shutil.which("setpriv")
JOB_DIR_INSIDE = "/work/job"
SESSION_DIR_INSIDE = "/work/session"
OOM_SCORE_ADJ_MAX = 1000


def _root_link_args() -> list[str]:
    """Recreate /bin, /lib, /lib64, /sbin as the host has them: symlinks into /usr on a
    merged-/usr system (Debian 12), read-only binds otherwise."""
    args: list[str] = []
    for name in ("bin", "lib", "lib64", "sbin"):
        path = Path("/", name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


ROOT_LINK_ARGS = _root_link_args()


def bwrap_argv(bwrap: str, mounts: list[str] | None = None) -> list[str]:
    """bwrap's command line; `mounts`: more mount options, made before the root turns read-only."""
    return [
        bwrap,
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--die-with-parent", "--as-pid-1", "--new-session",
        "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN",
        "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp",
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr", *ROOT_LINK_ARGS,
        "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--dir", "/tmp", "--dir", JOB_DIR_INSIDE, "--dir", SESSION_DIR_INSIDE,
        *(mounts or []),
        "--remount-ro", "/",
        "--chdir", "/",
        "--",
    ]  # fmt: skip


def spawn_server(
    spec: dict[str, object],
    control_fd: int,
    python: str,
    bwrap: str | None,
    uid: int | None,
    env: dict[str, str] | None = None,
    base: SessionBase | None = None,
    cow_caps: dict[str, int] | None = None,
) -> tuple[subprocess.Popen[bytes], object]:
    """Start the server; returns (process, its stderr file). `bwrap` None: reduced mode.
    `base`: a copy-on-write session (cow.py; needs bwrap, root and setpriv), its upper layer
    capped by `cow_caps` ({"bytes", "inodes"})."""
    spec = {**spec, "control_fd": control_fd}
    command = [python, "-I", "-B", "-c", BOOT_SOURCE, marshal.dumps(spec).hex()]
    mounts = cow.bwrap_args(base) if base is not None else None
    argv = [*bwrap_argv(bwrap, mounts), *command] if bwrap else command
    identity: dict[str, object] = {}
    if uid is not None and SETPRIV:  # never run bwrap as root: it would keep root's power
        argv = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
    elif uid is not None:
        identity = {"user": uid, "group": uid, "extra_groups": []}
    if base is not None:
        if not (bwrap and uid is not None and SETPRIV and cow_caps):
            raise ValueError("a copy-on-write session needs bubblewrap, root (slot uids) and setpriv")
        argv = cow.helper_argv(python, base, uid, cow_caps["bytes"], cow_caps["inodes"], argv)
    errors = tempfile.TemporaryFile()  # a file, not a pipe: a chatty failure never blocks it
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            pass_fds=(control_fd,),
            close_fds=True,
            cwd="/",
            env=env or {},
            start_new_session=True,  # its own process group, away from our terminal's signals
            **identity,  # type: ignore[arg-type]
        )
    except BaseException:
        errors.close()
        raise
    return process, errors


def set_oom_floor(pid: int) -> None:
    """oom_score_adj 1000 for `pid` (the slot's forker, boot.py), written by the host: a write
    by a process with CAP_SYS_RESOURCE also sets the floor below which the process and every
    process it forks later may not lower their own. Needs root."""
    with open(f"/proc/{pid}/oom_score_adj", "w") as adj:
        adj.write(str(OOM_SCORE_ADJ_MAX))


def read_tail(errors: object, limit: int = 2000) -> str:
    """The last `limit` characters a server wrote to its stderr file."""
    handle = errors  # a TemporaryFile
    try:
        handle.seek(0)  # type: ignore[attr-defined]
        return handle.read().decode("utf-8", errors="replace")[-limit:].strip()  # type: ignore[attr-defined]
    except (OSError, ValueError):
        return ""
