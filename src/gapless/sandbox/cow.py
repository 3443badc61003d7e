"""Copy-on-write session trees: a session's /work/session as an overlay of a shared, read-only tree.

A session opened with a `SessionBase` sees `base.tree` at /work/session: reads come from the
shared tree, writes go to an upper layer of its own (a tmpfs with the session's size and inode
caps), so a thousand sessions over one repository cost one copy of it, not a thousand. The
tree itself is also seen read-only at /work/base (what the session's changes are against), and
an optional `base.env` (installed dependencies) read-only at /work/env.

How (why this shape): an overlay mounted inside the slot's user namespace cannot copy up a file
whose owner that namespace does not map (EOVERFLOW), and every file of a shared tree has such an
owner. So the host mounts it instead, as root, in a private mount namespace of its own that
exists only for the session's bubblewrap: a helper (HELPER below, run by `helper_argv`)
unshares a mount namespace, mounts the capped tmpfs and the overlay there, then execs the usual
`setpriv ... bwrap ...` command line, whose `--bind` takes the overlay into the sandbox. The
mounts die with that namespace, i.e. with the session; the host's own mount table never sees
them. Inside, the session's processes are an unprivileged uid that does not own the tree's
files, so the tree must be readable and writable by others (`prepare_tree` makes such a copy,
once per tree, under a parent only root can enter): the overlay refuses writes to the shared
tree itself (it is a lower layer), and copies a file up before its first change.

Guaranteed: no write in a session reaches `base.tree` or another session; the upper layer is
capped like a session's tmpfs (size and inodes) and charged to the writer's memory cgroup;
nosuid and nodev on both mounts. Needs root (the slot uids already do).
NOT guaranteed: that `base.tree` is not changed by the host while sessions use it (overlay
then shows undefined mixtures: prepare a tree once and leave it alone).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

COW_DIR = Path("/run/gapless-sandbox-cow")  # an empty mount point, used only in private namespaces
ENV_DIR_INSIDE = "/work/env"
BASE_DIR_INSIDE = "/work/base"  # the shared tree as it is, read-only: what a session's changes are against
_UNSAFE = (",", ":", "\\", "\n")  # overlay's option syntax has no escape for these

HELPER = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
spec, argv = json.loads(sys.argv[1]), sys.argv[2:]
def check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        sys.stderr.write(f"copy-on-write mount: {what}: {os.strerror(errno)}\n")
        os._exit(70)
def mount(source, target, fstype, flags, options):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(options)), target)
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE, MS_RDONLY, MS_REMOUNT = 2, 4, 4096, 1 << 14, 1 << 18, 1, 32
check(libc.unshare(0x00020000), "unshare")
mount(None, "/", None, MS_REC | MS_PRIVATE, None)
top = spec["dir"]
mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['bytes']},nr_inodes={spec['inodes']},mode=0755")
for name in ("upper", "work", "view", "env", "base"):
    os.mkdir(os.path.join(top, name), 0o755)
os.chown(os.path.join(top, "upper"), spec["uid"], spec["uid"])  # the overlay's root directory
mount("overlay", top + "/view", "overlay", MS_NOSUID | MS_NODEV,
      f"lowerdir={spec['tree']},upperdir={top}/upper,workdir={top}/work")
for source, name in ((spec["tree"], "base"), (spec["env"], "env")):
    if source:
        mount(source, f"{top}/{name}", None, MS_BIND | MS_REC, None)
        mount(None, f"{top}/{name}", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
os.execv(argv[0], argv)
"""


@dataclass(frozen=True)
class SessionBase:
    """What a copy-on-write session starts from: `tree` (a prepared tree, `prepare_tree`) at
    /work/session, and optionally `env` read-only at /work/env."""

    tree: Path
    env: Path | None = None

    def __post_init__(self) -> None:
        for path in (self.tree, self.env):
            if path is not None and (not Path(path).is_absolute() or any(c in str(path) for c in _UNSAFE)):
                raise ValueError(f"{path}: a session base must be an absolute path without , : \\ or newlines")


def bwrap_args(base: SessionBase) -> list[str]:
    """The bwrap options that take the helper's mounts into the sandbox."""
    args = ["--bind", f"{COW_DIR}/view", "/work/session", "--ro-bind", f"{COW_DIR}/base", BASE_DIR_INSIDE]
    if base.env is not None:
        args += ["--ro-bind", f"{COW_DIR}/env", ENV_DIR_INSIDE]
    return args


def helper_argv(python: str, base: SessionBase, uid: int, size_bytes: int, inodes: int, argv: list[str]) -> list[str]:
    """`argv` (setpriv + bwrap), run by the helper after it has made the mounts."""
    COW_DIR.mkdir(mode=0o755, exist_ok=True)
    spec = {"dir": str(COW_DIR), "tree": str(base.tree), "env": str(base.env) if base.env else None,
            "uid": uid, "bytes": size_bytes, "inodes": inodes}  # fmt: skip
    return [python, "-I", "-B", "-c", HELPER, json.dumps(spec), *argv]


def prepare_tree(source: Path | Mapping[str, bytes], dest: Path) -> Path:
    """Write `source` (a directory, or relative path -> content) to `dest` as a copy-on-write
    base: regular files and directories only (links and special files are dropped), folders
    rwx and files rw for everyone (a directory's executables keep x). Returns `dest`. Keep
    `dest` under a folder only root can enter: the modes are for the sessions' uids, not the
    host's users."""
    if dest.exists():
        raise FileExistsError(dest)
    files = _files_of(source) if isinstance(source, Path) else {p: (data, False) for p, data in source.items()}
    dest.mkdir(parents=True)
    for rel, (data, is_executable) in files.items():
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError(f"{rel!r}: a tree's paths are relative, without '..'")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(0o777 if is_executable else 0o666)
    for folder, dirs, _ in os.walk(dest):
        for name in dirs:
            os.chmod(Path(folder) / name, 0o777)
    os.chmod(dest, 0o777)
    return dest


def _files_of(source: Path) -> dict[str, tuple[bytes, bool]]:
    files = {}
    for folder, dirs, names in os.walk(source):  # os.walk does not follow linked folders
        for name in names:
            path = Path(folder) / name
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                files[str(path.relative_to(source))] = (path.read_bytes(), bool(info.st_mode & 0o111))
    return files


def has_root() -> bool:
    return os.geteuid() == 0 and sys.platform.startswith("linux")
