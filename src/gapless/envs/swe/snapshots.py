"""Per-instance snapshots, made once per run: the files for grading and the shared session tree.

For each instance, on first use (thread-safe, once): its repository's files (`repo_path`, a
folder or a tarball; testrun.load_tree) kept in memory for the grading jobs, and the same files
written once as a copy-on-write base (sandbox/cow.py) under a folder only root can enter, which
every episode's session of that instance mounts: an episode costs its own writes, not a copy.
`close` removes the bases. Hidden tests are never in a snapshot of a built set (the build
leaves them out; `test_patch` restores them only in the grading job); a user's SWE-bench file
is trusted on that point.
NOT guaranteed: that `repo_path` does not change while the run uses it (it is read once).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from gapless.envs.swe.instances import SweInstance
from gapless.envs.swe.testrun import load_tree, python_path
from gapless.sandbox import SessionBase, prepare_tree
from gapless.sandbox.cow import ENV_DIR_INSIDE

SESSION_DIR = "/work/session"


@dataclass(frozen=True)
class Snapshot:
    files: dict[str, bytes]  # the repository as the agent first sees it
    base: SessionBase  # the same files, prepared for copy-on-write sessions
    python_path: str  # PYTHONPATH of the session's `run` and `test`: repository, then env


class SnapshotStore:
    def __init__(self) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="gapless-swe-"))  # 0700: only root enters
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._made: dict[str, Snapshot] = {}

    def get(self, instance: SweInstance) -> Snapshot:
        with self._lock:
            lock = self._locks.setdefault(instance.instance_id, threading.Lock())
        with lock:
            snapshot = self._made.get(instance.instance_id)
            if snapshot is None:
                snapshot = self._made[instance.instance_id] = self._make(instance)
            return snapshot

    def _make(self, instance: SweInstance) -> Snapshot:
        files = load_tree(instance.repo_path)
        name = hashlib.sha256(instance.instance_id.encode()).hexdigest()[:16]
        tree = prepare_tree(files, self._root / name)
        env = instance.env_path.resolve() if instance.env_path is not None else None
        paths = [SESSION_DIR if p == "." else f"{SESSION_DIR}/{p}" for p in python_path(files)]
        if env is not None:
            paths.append(ENV_DIR_INSIDE)
        return Snapshot(files, SessionBase(tree, env), ":".join(paths))

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
