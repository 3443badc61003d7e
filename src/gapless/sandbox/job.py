"""One job: the files of a program, which one is main, its arguments; and how it is shipped.

The host packs a job into a memfd (`pack`): the length of the table (8 bytes, little-endian),
the table `[(relative path, size), ...]` (marshal: the sandbox's init reads it without importing
anything), then the contents in that order. Init reads it inside the sandbox (boot.py `_write_files`). The
job's read-only tmpfs is sized from the pack so that it is full: the program cannot add files
even if it found a way to write there.

Guaranteed: `Job` rejects absolute paths, `..` and unnormalised names before anything runs.
"""

from __future__ import annotations

import marshal
import os
from dataclasses import dataclass
from pathlib import PurePosixPath

PAGE_BYTES = 4096


@dataclass(frozen=True)
class Judged:
    """A judged job (envs/code/environment.py): `main` is the judge; `candidate` (one of the files) runs in
    a process of its own that cannot see the files under the directory `private`."""

    candidate: str
    private: str


@dataclass(frozen=True)
class Job:
    files: dict[str, bytes]
    main: str
    args: tuple[str, ...] = ()
    judged: Judged | None = None

    @classmethod
    def of(cls, files: dict[str, str | bytes], main: str, args: tuple[str, ...] | list[str] = (),
           judged: Judged | None = None) -> Job:  # fmt: skip
        """Validate names and encode text as UTF-8; ValueError for a malformed job."""
        for name in files:
            parts = PurePosixPath(name).parts
            if not parts or name.startswith("/") or ".." in parts or str(PurePosixPath(name)) != name:
                raise ValueError(f"file name {name!r} must be a normalised relative path")
        if main not in files:
            raise ValueError(f"main {main!r} is not one of the files {sorted(files)}")
        if judged is not None:
            if judged.candidate not in files or judged.candidate.startswith(judged.private + "/"):
                raise ValueError(f"candidate {judged.candidate!r} must be one of the public files")
            if not any(name.startswith(judged.private + "/") for name in files):
                raise ValueError(f"private directory {judged.private!r} holds no file")
        encoded = {n: c.encode("utf-8") if isinstance(c, str) else bytes(c) for n, c in files.items()}
        return cls(encoded, main, tuple(str(arg) for arg in args), judged)

    def directories(self) -> set[str]:
        return {str(parent) for name in self.files for parent in PurePosixPath(name).parents[:-1]}

    def tmpfs_caps(self) -> dict[str, int]:
        """Size and inode count of the read-only tmpfs that holds exactly these files."""
        pages = sum(-(-len(content) // PAGE_BYTES) + 1 for content in self.files.values())
        inodes = len(self.files) + len(self.directories()) + 2
        return {"bytes": (pages + len(self.directories()) + 4) * PAGE_BYTES, "inodes": inodes}

    def pack(self) -> int:
        """A memfd holding the packed job (close-on-exec; the caller closes it)."""
        fd = os.memfd_create("gapless-job", os.MFD_CLOEXEC)
        try:
            table = marshal.dumps([(name, len(content)) for name, content in self.files.items()])
            with os.fdopen(os.dup(fd), "wb") as handle:
                handle.write(len(table).to_bytes(8, "little") + table)
                for content in self.files.values():
                    handle.write(content)
        except BaseException:
            os.close(fd)
            raise
        return fd
