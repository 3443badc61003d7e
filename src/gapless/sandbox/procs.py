"""Host-side process bookkeeping from /proc: the processes of a uid, the descendants of a pid,
and killing them.

The slot cgroup (cgroups.py) is the first choice for finding a slot's processes; these are the
fallback without one: every process of a slot's uid is its server's or its current job's,
whatever the job did (double fork, setsid, new process group), and without root the server's
descendants are the job. They need no third-party package.

Guaranteed: every function is bounded in time; the real uid (first field of `Uid:` in
/proc/PID/status) is used, which a process without capabilities cannot change.

NOT guaranteed: atomicity. A process may fork between a scan and the kill, so `kill_uid` repeats
scan-and-kill for a bounded number of rounds; under RLIMIT_NPROC the tree is small and one or
two rounds suffice. Killing another uid's processes needs root (or that uid).
"""

from __future__ import annotations

import os
import signal
import time

KILL_ROUNDS = 20
POLL_INTERVAL_S = 0.005


def scan_processes() -> list[tuple[int, int, str]]:
    """(pid, real uid, one-letter state such as R, S or Z) of every process on the host."""
    found: list[tuple[int, int, str]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:  # exited while we looked
            continue
        found.append((int(entry), int(fields["Uid"].split()[0]), fields["State"].split()[0]))
    return found


def processes_of_uid(uid: int) -> dict[int, str]:
    """pid -> state of every process whose real uid is `uid`, zombies included."""
    return {pid: state for pid, owner, state in scan_processes() if owner == uid}


def live_processes_of_uid(uid: int) -> list[int]:
    """Like `processes_of_uid`, without zombies (they are dead, only not yet reaped)."""
    return [pid for pid, state in processes_of_uid(uid).items() if state != "Z"]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, over all its threads (empty if it has exited)."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as children:
                found.extend(int(child) for child in children.read().split())
    except OSError:
        pass
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children (a snapshot)."""
    found: list[int] = []
    frontier = [pid]
    while frontier and len(found) < 100000:
        children = child_pids(frontier.pop())
        found.extend(children)
        frontier.extend(children)
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_uid(uid: int, spare_pid: int | None = None) -> int:
    """SIGKILL every live process of `uid` except `spare_pid`, in rounds until none is left.
    Returns how many distinct processes were signalled."""
    signalled: set[int] = set()
    for _ in range(KILL_ROUNDS):
        targets = [pid for pid in live_processes_of_uid(uid) if pid != spare_pid]
        if not targets:
            break
        kill_pids(targets)
        signalled.update(targets)
        time.sleep(POLL_INTERVAL_S)
    return len(signalled)


def wait_uid_gone(uid: int, timeout_s: float) -> dict[int, str]:
    """Wait until `uid` has no process at all, zombies included (they still count against
    RLIMIT_NPROC). Returns what is left after `timeout_s` (empty when clean)."""
    deadline = time.monotonic() + timeout_s
    left = processes_of_uid(uid)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        left = processes_of_uid(uid)
    return left
