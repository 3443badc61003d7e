"""A pool of prepared slots behind an admission semaphore; retries, quarantine and metrics.

A slot is a host uid (flock-claimed, slots.py), its cgroup (cgroups.py) and, on the warm path, a
running server (worker.py). Slots are prepared on first use and kept until `close`.

    callers (threads; coroutines go through `arun`, whose executor threads do the spawning, so
    no event loop ever blocks on a fork)
      --admission (max_concurrency: a burst queues here instead of inflating every run's latency)
      --> lowest free slot not excluded --> settle: is its previous run gone? (else restart its
          server, or quarantine a slot that cannot be emptied and take the next)
      --> worker.run --> release --> infra_error or killed? once more on another slot, and
          that result stands (infra_error is never scored: envs/code/environment.py)

Attribution (result.py, docs/sandbox.md): the pool's own infra_error verdicts are failures it
observed before the job was sent (no slot, no cgroup, no server, bwrap missing, a send that
failed); a run that started is classified by `classify` alone. A `killed` run (a death no limit
and no act of the host explains) is run again on a fresh slot, since a host-wide kill and the
program's own look alike: one that does not recur was the host's, one that does is the program's.

Guaranteed: at most `max_concurrency` runs at once; a job starts in a slot only after the check
that nothing of the slot's previous run is left (a warm slot's server is restarted otherwise,
and a slot that cannot be emptied is quarantined for the pool's lifetime); `close` leaves no
process, cgroup or flock of this pool behind. The check runs before a slot's next job rather
than after its last one, so that a caller gets its result without waiting for it.
NOT guaranteed: fairness between callers (first come, first served by the semaphore), or any
bound on the queue (the caller decides how much to submit).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gapless.sandbox import procs
from gapless.sandbox.cgroups import CgroupRoot, SlotCgroup
from gapless.sandbox.cow import SessionBase
from gapless.sandbox.job import Job
from gapless.sandbox.limits import SandboxLimits
from gapless.sandbox.result import SandboxResult, Status, classify
from gapless.sandbox.slots import SlotAllocator
from gapless.sandbox.worker import RunOutput, SlotFailure, SlotWorker

BWRAP_MISSING = "bwrap not found on PATH: install bubblewrap (apt-get install bubblewrap)"
WARM_START_TIMEOUT_S = 15.0
LAUNCHER_THREADS = 2
SETTLE_TRIES = 3
UID_SWEEP_SPAN = 4096  # slot uids checked for leftovers of a crashed service at start
WINDOW = 8192  # recent runs kept for latency percentiles
_RETRIED = (Status.INFRA_ERROR, Status.KILLED)  # once more on another slot: is it the slot or the job?


@dataclass
class Slot:
    index: int
    uid: int | None
    cgroup: SlotCgroup | None
    worker: SlotWorker | None = None  # warm path: kept between runs


class SlotPool:
    def __init__(self, *, python: str, bwrap: str | None, warm: bool, max_concurrency: int,
                 uid_base: int | None, cgroups: CgroupRoot | None, lock_dir: Path | None,
                 is_reduced: bool = False) -> None:  # fmt: skip
        self.python = python
        self.bwrap = None if is_reduced else bwrap  # None and not reduced: bwrap is missing
        self.is_reduced = is_reduced
        self.warm = warm and not is_reduced  # reduced mode is always cold (see reduced.py)
        self.max_concurrency = max_concurrency
        self.uid_base = uid_base
        self.cgroups = cgroups
        self._allocator = SlotAllocator(uid_base or 0, lock_dir)
        self._admission = threading.BoundedSemaphore(max_concurrency)
        self._slots: dict[int, Slot] = {}
        self._leases: list[Slot] = []  # slots held by sessions
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sandbox")
        # Warm servers are started from these long-lived threads, never from a caller's: bwrap's
        # --die-with-parent is a parent-death signal, which the kernel sends when the *thread*
        # that forked it exits (measured: a caller's short-lived pool killed every warm server).
        self._launcher = ThreadPoolExecutor(LAUNCHER_THREADS, thread_name_prefix="sandbox-launch")
        self._counts = {"runs": 0, "infra_errors": 0, "infra_retries": 0, "killed_retries": 0, "slot_restarts": 0}
        self._queue_s: deque[float] = deque(maxlen=WINDOW)
        self._run_s: deque[float] = deque(maxlen=WINDOW)
        self._closed = False
        if cgroups is not None and uid_base is not None:
            self._sweep_stale_cgroups()

    @property
    def path(self) -> str:
        return "reduced" if self.is_reduced else ("warm" if self.warm else "cold")

    @property
    def quarantined(self) -> frozenset[int]:
        return self._allocator.quarantined

    def run(self, job: Job, limits: SandboxLimits, submitted_s: float | None = None) -> SandboxResult:
        """Run `job` under `limits`; blocks while `max_concurrency` runs are in flight."""
        submitted_s = time.monotonic() if submitted_s is None else submitted_s
        with self._admission:
            if self._closed:
                raise RuntimeError("the sandbox pool is closed")
            queue_s = time.monotonic() - submitted_s
            result = self._attempt(job, limits, exclude=frozenset())
            if result.status in _RETRIED:  # the second result stands, whatever it is (result.py)
                self._count("infra_retries" if result.status is Status.INFRA_ERROR else "killed_retries")
                failed = frozenset({result.slot}) if result.slot is not None else frozenset()
                result = self._attempt(job, limits, exclude=failed)
                result.attempts = 2
        result.queue_s = queue_s
        with self._lock:
            self._counts["runs"] += 1
            self._counts["infra_errors"] += result.status is Status.INFRA_ERROR
            self._queue_s.append(queue_s)
            self._run_s.append(result.wall_s)
        return result

    async def arun(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        """`run` on the pool's own threads: the caller's event loop never blocks."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, job, limits, time.monotonic())

    def lease(self, session_limits: SandboxLimits, base: SessionBase | None = None) -> Slot:
        """A slot held until `give_back`, with a started session server (sessions); `base`:
        its /work/session is a copy-on-write view of that tree (cow.py)."""
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        index = self._allocator.acquire()
        try:
            slot = self._slot(index)
            if not self._settle(slot):
                raise SlotFailure(f"slot {index} could not be emptied")
            if slot.worker is not None:
                slot.worker.stop()  # a warm job server: the session brings its own
            slot.worker = SlotWorker(
                uid=slot.uid,
                cgroup=slot.cgroup,
                python=self.python,
                bwrap=self.bwrap,
                warm=True,
                session_limits=session_limits,
                session_base=base,
            )
            self._start_warm(slot.worker)
        except BaseException:
            self._allocator.release(index, is_clean=self._empty(self._slots.get(index)))
            raise
        with self._lock:
            self._leases.append(slot)
        return slot

    def give_back(self, slot: Slot) -> None:
        """End a lease: stop its server, empty the slot (or quarantine it)."""
        with self._lock:
            if self._closed or slot not in self._leases:
                return  # `close` has stopped it already
            self._leases.remove(slot)
        is_clean = slot.worker.stop() if slot.worker is not None else True
        slot.worker = None
        self._allocator.release(slot.index, is_clean=self._empty(slot) and is_clean)

    def leftovers(self) -> list[str]:
        """Settle every slot and describe whatever of a finished run is still there (a process
        that is not a slot's server, a slot that cannot be emptied). Waits for in-flight runs;
        empty means clean."""
        found: list[str] = []
        for _ in range(self.max_concurrency):
            self._admission.acquire()
        try:
            for slot in list(self._slots.values()):
                if slot not in self._leases:
                    found += self._inspect(slot)
                    if not self._settle(slot):
                        found.append(f"slot {slot.index} (uid {slot.uid}) could not be emptied")
        finally:
            for _ in range(self.max_concurrency):
                self._admission.release()
        return found

    def _inspect(self, slot: Slot) -> list[str]:
        """What of a finished run is still in `slot`, without cleaning it (but a warm server
        that fails its check is stopped)."""
        where = f"slot {slot.index} (uid {slot.uid})"
        if slot.worker is not None and slot.worker.is_running:
            if slot.worker.settle():
                return []
            return [f"{where}: a finished run left processes or its server broke"]
        if slot.cgroup is not None:
            left = slot.cgroup.pids()
        elif slot.uid is not None:
            left = set(procs.live_processes_of_uid(slot.uid))
        else:
            left = set()
        return [f"{where}: processes left: {sorted(left)}"] if left else []

    def metrics(self) -> dict[str, float]:
        """`sandbox/*` counters since start and latency percentiles of the recent runs."""
        with self._lock:
            metrics = {f"sandbox/{name}_total": float(v) for name, v in self._counts.items()}
            queue_s, run_s = sorted(self._queue_s), sorted(self._run_s)
        metrics["sandbox/quarantined"] = float(len(self.quarantined))
        for name, values in (("queue_s", queue_s), ("run_s", run_s)):
            for q in (50, 99):
                metrics[f"sandbox/{name}_p{q}"] = _percentile(values, q)
        return metrics

    def close(self) -> None:
        """Stop every server, remove every cgroup, drop every flock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        for _ in range(self.max_concurrency):  # in-flight runs end by their own deadlines
            self._admission.acquire()
        for slot in list(self._slots.values()) + list(self._leases):
            if slot.worker is not None:
                slot.worker.stop()
            if slot.cgroup is not None:
                slot.cgroup.remove()
        self._slots.clear()
        self._leases.clear()
        self._launcher.shutdown(wait=True)
        self._allocator.close()
        if self.cgroups is not None:
            self.cgroups.remove_parents()

    def _attempt(self, job: Job, limits: SandboxLimits, exclude: frozenset[int]) -> SandboxResult:
        for _ in range(SETTLE_TRIES):  # a slot that cannot be emptied is quarantined, next one
            index = self._allocator.acquire(exclude)
            try:
                slot = self._slot(index)
            except SlotFailure as failure:  # its cgroup could not be made: nothing ran
                self._allocator.release(index, is_clean=True)
                result = _infra_result(str(failure), time.monotonic(), self.path)
                result.slot = index
                return result
            if not self._settle(slot):
                self._allocator.release(index, is_clean=False)
                continue
            try:
                result = self._run_on(slot, job, limits)
            finally:  # released unverified: `_settle` checks it before its next run
                self._allocator.release(index, is_clean=True)
            result.slot = index
            return result
        return _infra_result(f"no clean slot after {SETTLE_TRIES} tries", time.monotonic(), self.path)

    def _start_warm(self, worker: SlotWorker) -> None:
        """Start a long-lived server from a launcher thread (see `__init__`)."""
        self._launcher.submit(worker.start, WARM_START_TIMEOUT_S).result()

    def _settle(self, slot: Slot) -> bool:
        """Before a run: True if nothing of the slot's previous run is left. A warm server
        that is broken or not alone in its slot is stopped (and restarted by the run); False
        if the slot cannot be emptied, which quarantines it."""
        worker = slot.worker
        if worker is not None and worker.is_running:
            if worker.settle():
                return True
            worker.stop()
        return self._empty(slot)

    def _run_on(self, slot: Slot, job: Job, limits: SandboxLimits) -> SandboxResult:
        if self.bwrap is None and not self.is_reduced:  # never run bare without being asked
            return _infra_result(BWRAP_MISSING, time.monotonic(), self.path)
        if self.warm:
            if slot.worker is None:
                slot.worker = self._worker(slot, warm=True)
            worker = slot.worker
            if worker.needs_restart:
                if worker.starts:
                    self._count("slot_restarts")  # broken, dirty, or at its job limit
                worker.stop()
                try:
                    self._start_warm(worker)
                except SlotFailure as failure:
                    return _infra_result(str(failure), time.monotonic(), self.path)
            start_s = time.monotonic()
        else:
            worker = self._worker(slot, warm=False)
            start_s = time.monotonic()
            try:
                worker.start(WARM_START_TIMEOUT_S)  # start-up is not the program's time
            except SlotFailure as failure:
                return _infra_result(str(failure), start_s, self.path)
        try:
            output = worker.run(job, limits, start_s)
        except SlotFailure as failure:
            worker.stop()
            return _infra_result(str(failure), start_s, self.path)
        finally:
            if not self.warm:
                worker.stop()
        return _to_result(output, self.path)

    def _empty(self, slot: Slot | None) -> bool:
        """Kill whatever is left in a slot whose server is stopped; True if nothing is."""
        if slot is None:
            return True
        if slot.cgroup is not None:
            return slot.cgroup.kill_all()
        if slot.uid is not None:
            procs.kill_uid(slot.uid)
            return not procs.wait_uid_gone(slot.uid, 1.0)
        return True  # not root: the pid namespace (or the process group) was the only net

    def _slot(self, index: int) -> Slot:
        with self._lock:
            slot = self._slots.get(index)
            if slot is not None:
                return slot
        uid = self.uid_base + index if self.uid_base is not None else None
        cgroup = None
        if self.cgroups is not None and uid is not None:
            try:
                cgroup = self.cgroups.slot(uid)
            except OSError as error:
                raise SlotFailure(f"could not create the slot's cgroup: {error}") from error
        slot = Slot(index, uid, cgroup)
        with self._lock:
            self._slots[index] = slot
        return slot

    def _worker(self, slot: Slot, warm: bool) -> SlotWorker:
        return SlotWorker(uid=slot.uid, cgroup=slot.cgroup, python=self.python,
                          bwrap=self.bwrap, warm=warm)  # fmt: skip

    def _sweep_stale_cgroups(self) -> None:
        assert self.cgroups is not None and self.uid_base is not None
        stale = [uid - self.uid_base for uid in self.cgroups.stale_uids()
                 if 0 <= uid - self.uid_base < UID_SWEEP_SPAN]  # fmt: skip
        cgroups = self.cgroups
        uid_base = self.uid_base
        self._allocator.sweep(stale, lambda index: cgroups.slot(uid_base + index).remove())

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


def _to_result(output: RunOutput, path: str) -> SandboxResult:
    status, limit, exit_code, signum = classify(output.seen)
    stderr = output.seen.stderr.decode("utf-8", errors="replace")
    if status is Status.INFRA_ERROR and not stderr.strip():
        if output.seen.has_started:  # a judged job's judge: its candidate's start-up failed
            stderr = "the candidate's process ended in its start-up, before any code of the completion ran"
        elif output.seen.is_deadline_hit:
            stderr = "the sandbox did not start the program before the deadline"
        else:
            stderr = "the sandbox ended before the program started, without a report"
    return SandboxResult(
        status=status,
        exit_code=exit_code,
        signal=signum,
        stdout=output.stdout.decode("utf-8", errors="replace"),
        stderr=stderr if status is not Status.COMPILE_ERROR else (output.seen.compile_error or ""),
        wall_s=output.wall_s,
        truncated=output.seen.is_truncated,
        limit=limit,
        report=output.report if status is not Status.INFRA_ERROR else b"",
        cpu_s=output.seen.cpu_s,
        path=path,
    )


def _infra_result(message: str, start_s: float, path: str) -> SandboxResult:
    return SandboxResult(Status.INFRA_ERROR, None, None, "", message,
                         time.monotonic() - start_s, False, None, b"", path=path)  # fmt: skip


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]
