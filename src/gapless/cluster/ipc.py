"""Named IPC objects of a run, and their clean-up after a crash.

The pipeline's queues, locks and events are multiprocessing objects backed by named POSIX
semaphores (`/dev/shm/sem.*`). A run that exits normally unlinks them; a trainer killed with
SIGKILL leaves them to multiprocessing's resource tracker, and when the tracker dies too (the
whole process group killed, the OOM killer) they stay until reboot. So the trainer names them
`mp-gapless-<run key>-<pid>-*` (the run key hashes the run directory), and the next start in the
same run directory unlinks those whose creating process is gone. Weight buffers need nothing
here: torch's shared tensors are file descriptors whose names are unlinked at creation.
Not guaranteed: clean-up of objects made by other libraries inside the actors.
"""

from __future__ import annotations

import hashlib
import multiprocessing.process
import os
from pathlib import Path

SHM = Path("/dev/shm")


def run_key(run_dir: Path) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


def name_ipc_objects(run_dir: Path) -> None:
    """Make this process's next multiprocessing semaphores carry the run's key and this pid."""
    multiprocessing.process.current_process()._config["semprefix"] = f"/mp-gapless-{run_key(run_dir)}-{os.getpid()}"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_ipc(run_dir: Path) -> list[Path]:
    """Semaphores of this run directory whose creating process is gone."""
    prefix = f"sem.mp-gapless-{run_key(run_dir)}-"
    found = []
    for path in SHM.glob(prefix + "*") if SHM.is_dir() else []:
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _is_alive(int(pid)):
            found.append(path)
    return found


def clean_leftover_ipc(run_dir: Path) -> int:
    """Unlink what a crashed run in `run_dir` left in /dev/shm; returns how many."""
    removed = 0
    for path in leftover_ipc(run_dir):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
