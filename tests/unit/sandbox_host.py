"""The host-side state a sandbox may leave behind, for before/after checks in the sandbox tests.

Clean means, once the sandbox is closed: no process of a test slot uid, no cgroup directory of
one, no flock held on one, the host's mounts unchanged, nothing left in the temp dir. Test slot
uids are their own range, away from a service's and from other test runs (whose processes would
otherwise count as ours).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gapless.sandbox import procs
from gapless.sandbox.bwrap import SLOT_LOCK_DIR
from gapless.sandbox.probes import SCRATCH_PREFIX

SLOT_UID_BASE = 260000
SLOT_UID_SPAN = 64
IS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bwrap not installed: apt-get install bubblewrap to run the sandbox tests",
)


def host_state() -> dict[str, object]:
    """What a sandbox may leave behind, for a before/after comparison."""
    uids = range(SLOT_UID_BASE, SLOT_UID_BASE + SLOT_UID_SPAN)
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = sorted(line.split()[4] for line in mountinfo)
    cgroups = sorted(
        str(path) for path in Path("/sys/fs/cgroup").glob("*/**/gapless-sandbox/uid-*") if int(path.name[4:]) in uids
    )
    return {
        "processes": [pid for pid, uid, _ in procs.scan_processes() if uid in uids],
        "cgroups": cgroups,
        "mounts": mounts,
        "scratch": sorted(n for n in os.listdir(tempfile.gettempdir()) if n.startswith(SCRATCH_PREFIX)),
        "locked_uids": [uid for uid in uids if _is_locked(uid)],
    }


def _is_locked(uid: int) -> bool:
    path = SLOT_LOCK_DIR / f"uid-{uid}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def assert_host_clean(before: dict[str, object]) -> None:
    after = host_state()
    assert after["processes"] == [], "processes of a slot uid outlived the sandbox"
    assert after["cgroups"] == [], "a slot cgroup outlived the sandbox"
    assert after["locked_uids"] == [], "a slot flock outlived the sandbox"
    assert after["mounts"] == before["mounts"], "the host's mounts changed"
    assert after["scratch"] == before["scratch"], "a job directory was left in the temp dir"
