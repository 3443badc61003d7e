"""Stateful sandbox sessions for multi-turn tool use: files and a live process across calls.

A session leases one slot (its own uid and cgroup) and starts a server in it whose mount
namespace holds a tmpfs at /work/session (size and inode caps from the limits), or, opened with
a `SessionBase`, a copy-on-write view of a shared tree there, its writes capped the same way
(cow.py). Its live process
is a job like any other (boot.py: fresh pid, mount and IPC namespaces, no capabilities, rlimits)
running repl.py with cwd /work/session. Calls exchange framed messages with it (repl.py).

    caller --run(code)--> [lock] write request to the repl's stdin
                          read stdout, stderr and the reply (fd 3) until the reply or deadline
                          deadline: kill the live process, settle the slot, start a new one
                          (files stay: they belong to the server's mount namespace)

Guaranteed: every call ends by its deadline and returns a status whatever the live process
sends (its replies are read by frames.py, each within the cap its call needs: a header's, or a
snapshot's); every isolation property of a job holds (the session is just a long job); the
session is closed, and its slot emptied, after `idle_timeout_s` without a call, on `close`, or
when the sandbox closes. Attribution: INFRA_ERROR only when the host saw the session fail before
any request reached a started live process; a slot failure after that is `is_lost` (the model's
code may have caused it), a typed field, never a message to match.
NOT guaranteed: that the live process survives a call (a timeout, os._exit or a memory kill ends
it: the next call gets a fresh one with an empty namespace, `restarted` says so, and only the
files are kept); snapshot contents are made inside the sandbox and are opaque to the host,
which never unpickles or unpacks them.
"""

from __future__ import annotations

import marshal
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from gapless.sandbox.cow import SessionBase
from gapless.sandbox.frames import ReplyReader
from gapless.sandbox.job import Job
from gapless.sandbox.limits import MIB, SandboxLimits
from gapless.sandbox.pool import Slot, SlotPool
from gapless.sandbox.result import SandboxError, Status
from gapless.sandbox.streams import READ_CHUNK_BYTES, CappedSink, ready
from gapless.sandbox.worker import JobPipes, SlotFailure

REPL = Job.of({"repl.py": Path(__file__).with_name("repl.py").read_bytes()}, "repl.py")
LIVE_PROCESS_CPU_S = 3600.0  # RLIMIT_CPU of the live process, over all its calls


@dataclass
class SessionResult:
    status: Status  # ok, nonzero_exit (the code raised), timeout, output_limit, memory_limit...;
    # infra_error only when the host saw the session fail before any request reached a live process
    stdout: str
    stderr: str
    wall_s: float
    error: str | None = None  # the exception the code raised, as text
    restarted: bool = False  # the live process ended, during this call or before it: its
    # namespace is lost (a new live process starts empty; a snapshot's variables live only in
    # the snapshot, never in the session's files); the files in /work/session are kept
    is_lost: bool = False  # the session's slot failed after the model's code had run in it (a
    # death that code could have caused): the session is closed, its files are gone; the
    # caller's own status (never infra_error)
    violation: str | None = None  # how the live process broke the reply protocol (frames.py);
    # it was ended


class SnapshotFailed(Exception):
    """A snapshot did not come back; `result` says why (its status: the model's doing unless
    INFRA_ERROR)."""

    def __init__(self, result: SessionResult) -> None:
        super().__init__(f"snapshot failed: {result.status.value}")
        self.result = result


class SandboxSession:
    def __init__(self, pool: SlotPool, limits: SandboxLimits, idle_timeout_s: float,
                 base: SessionBase | None = None) -> None:  # fmt: skip
        self.limits = limits
        self.idle_timeout_s = idle_timeout_s
        self._pool = pool
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._pipes: JobPipes | None = None
        self._slot: Slot | None = pool.lease(limits, base)
        self._live_limits = replace(limits, cpu_s=LIVE_PROCESS_CPU_S)
        self._status = CappedSink(1 << 16)  # the live process's status pipe
        self._blob_cap_bytes = 2 * limits.tmp_size_mb * MIB + MIB  # a snapshot: files + namespace
        self._has_started = False
        self._has_run_code = False  # a request reached a started live process of this session
        self._lost: SessionResult | None = None  # set when the slot failed under the model's code
        self._touch()

    @property
    def is_closed(self) -> bool:
        return self._slot is None

    def run(self, code: str, timeout_s: float | None = None) -> SessionResult:
        """Execute `code` in the live process's namespace, cwd /work/session."""
        return self._call({"op": "run", "code": code}, timeout_s)[0]

    def snapshot(self, timeout_s: float | None = None) -> bytes:
        """The session's state (its files, and the picklable values of its namespace), as an
        opaque blob for `restore` in this or another session; `SnapshotFailed` otherwise."""
        result, blob = self._call({"op": "snapshot"}, timeout_s, expects_blob=True)
        if result.status is not Status.OK or blob is None:
            raise SnapshotFailed(result)
        return blob

    def restore(self, snapshot: bytes, timeout_s: float | None = None) -> SessionResult:
        """Replace the session's files and namespace with those of `snapshot`. NONZERO_EXIT with
        an `error` when the namespace does not load (the model's values): the files are back,
        the namespace is empty."""
        return self._call({"op": "restore", "snapshot": bytes(snapshot)}, timeout_s)[0]

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: dict[str, object], timeout_s: float | None,
              expects_blob: bool = False) -> tuple[SessionResult, bytes | None]:  # fmt: skip
        with self._lock:
            start_s = time.monotonic()
            if self._slot is None:
                if self._lost is not None:  # closed under the model's code: still its outcome
                    return replace(self._lost, wall_s=0.0), None
                raise SandboxError("the session is closed (idle timeout, close, or sandbox closed)")
            self._disarm()  # a call is not idle time, however long it runs
            deadline = start_s + (timeout_s or self.limits.timeout_s)
            try:
                restarted = self._ensure_live()
                reader = ReplyReader(expects_blob, self._blob_cap_bytes)
                result = self._exchange(marshal.dumps(request), deadline, reader)
            except (SlotFailure, OSError) as failure:  # the slot, not the live process
                return self._slot_failed(failure, start_s), None
            result.wall_s = time.monotonic() - start_s
            result.restarted = result.restarted or restarted
            self._touch()
            is_whole = reader.reply is not None and reader.violation is None
            return result, reader.reply.blob if is_whole else None

    def _slot_failed(self, failure: Exception, start_s: float) -> SessionResult:
        """The slot failed: infra_error if no request ever reached a live process of this
        session, else the model's (its code may have caused it: the session is lost)."""
        self._close_locked()
        wall_s = time.monotonic() - start_s
        if not self._has_run_code:
            return SessionResult(Status.INFRA_ERROR, "", str(failure), wall_s)
        self._lost = SessionResult(Status.NONZERO_EXIT, "", "", wall_s, restarted=True, is_lost=True)
        return replace(self._lost)

    def _ensure_live(self) -> bool:
        """Start the live process if there is none; True if an earlier one had ended. One that
        ended, or wrote on its reply channel, between calls is ended and replaced."""
        if self._pipes is not None and self._is_spoiled(self._pipes):
            self._end_live_process()
        if self._pipes is not None:
            return False
        worker = self._worker()
        if not worker.settle():
            raise SlotFailure("the session's slot could not be emptied; its files are lost")
        self._pipes = worker.submit(REPL, self._live_limits, with_stdin=True)
        self._status = CappedSink(1 << 16)
        is_restart, self._has_started = self._has_started, True
        return is_restart

    def _is_spoiled(self, pipes: JobPipes) -> bool:
        """Between calls the reply channel is silent and the process alive; anything else (a
        background thread's frames, an exit) leaves the next reply unreadable."""
        if ready([pipes.report], 0):
            return True
        while ready([pipes.status], 0):
            chunk = os.read(pipes.status, READ_CHUNK_BYTES)
            self._status.feed(chunk)
            if not chunk or self._status.is_truncated:
                return True
        return b'"exit"' in self._status.data

    def _exchange(self, payload: bytes, deadline: float, reader: ReplyReader) -> SessionResult:
        pipes = self._pipes
        assert pipes is not None and pipes.stdin is not None
        outputs = {pipes.stdout: CappedSink(self.limits.max_output_bytes),
                   pipes.stderr: CappedSink(self.limits.max_output_bytes)}  # fmt: skip
        is_written = _write_all(pipes.stdin, len(payload).to_bytes(8, "little"), deadline) and _write_all(
            pipes.stdin, payload, deadline
        )  # a restore's archive: no copy
        ended, heard = not is_written, False
        while not ended and not reader.is_done and time.monotonic() < deadline:
            for fd in ready([*outputs, pipes.report, pipes.status], deadline - time.monotonic()):
                chunk = os.read(fd, READ_CHUNK_BYTES)
                if fd in outputs:
                    outputs[fd].feed(chunk)
                elif fd == pipes.report:
                    heard = True
                    reader.feed(chunk)
                    ended = ended or not chunk
                else:  # after its start line, the status pipe speaks when the process ends
                    self._status.feed(chunk)
                    ended = ended or not chunk or b'"exit"' in self._status.data
        _drain(outputs)  # what it printed before its reply is already in the pipes
        _drain({pipes.status: self._status})
        if heard or _has_started(self._status.data):
            self._has_run_code = True  # a started live process had the request: model code ran
        elif not self._has_run_code:  # the host's own start-up failed: nothing of the model ran
            raise SlotFailure(f"the session's live process did not start: {_infra_line(self._status.data)}")
        stdout, stderr = (bytes(sink.data).decode("utf-8", "replace") for sink in outputs.values())
        truncated = any(sink.is_truncated for sink in outputs.values())
        violation = reader.violation
        if reader.reply is None or violation is not None:  # timeout, crash, broken protocol
            self._end_live_process()  # its state is unknown: the next call gets a new one
            if violation is not None and violation.too_large:
                status = Status.OUTPUT_LIMIT
            elif violation is None and time.monotonic() >= deadline:
                status = Status.TIMEOUT
            else:
                status = Status.NONZERO_EXIT
            reason = violation.reason if violation is not None else None
            return SessionResult(status, stdout, stderr, 0.0, restarted=True, violation=reason)
        reply = reader.reply
        status = Status.OUTPUT_LIMIT if truncated else Status.OK if reply.ok else Status.NONZERO_EXIT
        return SessionResult(status, stdout, stderr, 0.0, error=reply.error)

    def _end_live_process(self) -> None:
        pipes, self._pipes = self._pipes, None
        try:
            self._worker().kill_job()
        finally:
            if pipes is not None:
                for fd in (pipes.stdout, pipes.stderr, pipes.report, pipes.status, pipes.stdin):
                    if fd is not None:
                        os.close(fd)

    def _worker(self):
        assert self._slot is not None and self._slot.worker is not None
        return self._slot.worker

    def _close_locked(self) -> None:
        self._disarm()
        if self._slot is None:
            return
        slot, self._slot = self._slot, None
        try:
            if self._pipes is not None and slot.worker is not None:
                self._slot = slot  # `_end_live_process` kills through the slot's worker
                self._end_live_process()
        finally:
            self._slot = None
            self._pool.give_back(slot)  # it stops the server and empties (or quarantines) the slot

    def _touch(self) -> None:
        """(Re)arm the idle timer."""
        self._disarm()
        self._timer = threading.Timer(self.idle_timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        """The idle timer fired: close, unless a call came (and re-armed it) meanwhile."""
        with self._lock:
            if threading.current_thread() is self._timer:
                self._close_locked()


def _has_started(status: bytearray) -> bool:
    return b'"started": true' in status


def _infra_line(status: bytearray) -> str:
    """The start-up failure the sandbox reported (boot.py's infra line), if any."""
    for raw in bytes(status).splitlines():
        if raw.startswith(b'{"infra"'):
            return raw.decode("utf-8", "replace")[:300]
    return "no start line"


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write `data` to a pipe without blocking past `deadline`; False if it could not."""
    view = memoryview(data)
    os.set_blocking(fd, False)
    while view:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0 or not ready([fd], remaining_s, write=True):
            return False
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            return False
    return True


def _drain(outputs: dict[int, CappedSink]) -> None:
    """Read what is already in the pipes (bounded: a daemon may keep writing)."""
    for fd, sink in outputs.items():
        for _ in range(64):
            if not ready([fd], 0):
                break
            chunk = os.read(fd, READ_CHUNK_BYTES)
            if not chunk:
                break
            sink.feed(chunk)
