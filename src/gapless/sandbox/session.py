"""Stateful sandbox sessions for multi-turn tool use: files and a live process across calls.

A session leases one slot (its own uid and cgroup) and starts a server in it whose mount
namespace holds a tmpfs at /work/session (size and inode caps from the limits). Its live process
is a job like any other (boot.py: fresh pid, mount and IPC namespaces, no capabilities, rlimits)
running repl.py with cwd /work/session. Calls exchange framed messages with it (repl.py).

    caller --run(code)--> [lock] write request to the repl's stdin
                          read stdout, stderr and the reply (fd 3) until the reply or deadline
                          deadline: kill the live process, settle the slot, start a new one
                          (files stay: they belong to the server's mount namespace)

Guaranteed: every call ends by its deadline; every isolation property of a job holds (the
session is just a long job); the session is closed, and its slot emptied, after
`idle_timeout_s` without a call, on `close`, or when the sandbox closes.
NOT guaranteed: that the live process survives a call (a timeout, os._exit or a memory kill ends
it: the next call gets a fresh one with an empty namespace, `restarted` says so, and only the
files are kept); snapshot contents are made inside the sandbox and are opaque to the host,
which never unpickles or unpacks them.
"""

from __future__ import annotations

import base64
import json
import marshal
import os
import select
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from gapless.sandbox.job import Job
from gapless.sandbox.limits import MIB, SandboxLimits
from gapless.sandbox.pool import Slot, SlotPool
from gapless.sandbox.result import SandboxError, Status
from gapless.sandbox.streams import READ_CHUNK_BYTES, CappedSink
from gapless.sandbox.worker import JobPipes, SlotFailure

REPL = Job.of({"repl.py": Path(__file__).with_name("repl.py").read_bytes()}, "repl.py")
LIVE_PROCESS_CPU_S = 3600.0  # RLIMIT_CPU of the live process, over all its calls


@dataclass
class SessionResult:
    status: Status  # ok, nonzero_exit (the code raised), timeout, output_limit, memory_limit...
    stdout: str
    stderr: str
    wall_s: float
    error: str | None = None  # the exception the code raised, as text
    restarted: bool = False  # the live process ended, during this call or before it: its
    # namespace is lost (a new live process starts empty; a snapshot's variables live only in
    # the snapshot, never in the session's files); the files in /work/session are kept


class SandboxSession:
    def __init__(self, pool: SlotPool, limits: SandboxLimits, idle_timeout_s: float) -> None:
        self.limits = limits
        self.idle_timeout_s = idle_timeout_s
        self._pool = pool
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._pipes: JobPipes | None = None
        self._slot: Slot | None = pool.lease(limits)
        self._live_limits = replace(limits, cpu_s=LIVE_PROCESS_CPU_S)
        self._status = CappedSink(1 << 16)  # the live process's status pipe
        self._reply: dict[str, object] = {}
        self._has_started = False
        self._touch()

    @property
    def is_closed(self) -> bool:
        return self._slot is None

    def run(self, code: str, timeout_s: float | None = None) -> SessionResult:
        """Execute `code` in the live process's namespace, cwd /work/session."""
        return self._call({"op": "run", "code": code}, timeout_s)

    def snapshot(self, timeout_s: float | None = None) -> bytes:
        """The session's state (its files, and the picklable values of its namespace), as an
        opaque blob for `restore` in this or another session."""
        result = self._call({"op": "snapshot"}, timeout_s)
        if result.status is not Status.OK or not isinstance(self._reply.get("snapshot"), str):
            raise SandboxError(f"snapshot failed: {result.status.value} {result.error or result.stderr}")
        return base64.b64decode(self._reply["snapshot"])

    def restore(self, snapshot: bytes, timeout_s: float | None = None) -> SessionResult:
        """Replace the session's files and namespace with those of `snapshot`. NONZERO_EXIT with
        an `error` when the namespace does not load (the model's values): the files are back,
        the namespace is empty."""
        return self._call({"op": "restore", "snapshot": snapshot}, timeout_s)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: dict[str, object], timeout_s: float | None) -> SessionResult:
        with self._lock:
            if self._slot is None:
                raise SandboxError("the session is closed (idle timeout, close, or sandbox closed)")
            self._disarm()  # a call is not idle time, however long it runs
            start_s = time.monotonic()
            deadline = start_s + (timeout_s or self.limits.timeout_s)
            try:
                restarted = self._ensure_live()
                result = self._exchange(marshal.dumps(request), deadline)
            except SlotFailure as failure:
                self._close_locked()
                return SessionResult(Status.INFRA_ERROR, "", str(failure), time.monotonic() - start_s)
            result.wall_s = time.monotonic() - start_s
            result.restarted = result.restarted or restarted
            self._touch()
            return result

    def _ensure_live(self) -> bool:
        """Start the live process if there is none; True if an earlier one had ended."""
        if self._pipes is not None:
            return False
        worker = self._worker()
        if not worker.settle():
            raise SlotFailure("the session's slot could not be emptied; its files are lost")
        self._pipes = worker.submit(REPL, self._live_limits, with_stdin=True)
        self._status = CappedSink(1 << 16)
        is_restart, self._has_started = self._has_started, True
        return is_restart

    def _exchange(self, payload: bytes, deadline: float) -> SessionResult:
        pipes = self._pipes
        assert pipes is not None and pipes.stdin is not None
        outputs = {pipes.stdout: CappedSink(self.limits.max_output_bytes),
                   pipes.stderr: CappedSink(self.limits.max_output_bytes)}  # fmt: skip
        reply = CappedSink(2 * self.limits.tmp_size_mb * MIB + MIB)
        is_written = _write_all(pipes.stdin, len(payload).to_bytes(8, "little") + payload, deadline)
        ended = not is_written
        while not ended and _frame(reply.data) is None and time.monotonic() < deadline:
            ready, _, _ = select.select([*outputs, pipes.report, pipes.status], [], [],
                                       max(deadline - time.monotonic(), 0))  # fmt: skip
            for fd in ready:
                chunk = os.read(fd, READ_CHUNK_BYTES)
                if fd in outputs:
                    outputs[fd].feed(chunk)
                elif fd == pipes.report:
                    reply.feed(chunk)
                    ended = ended or not chunk
                else:  # after its start line, the status pipe speaks when the process ends
                    self._status.feed(chunk)
                    ended = ended or not chunk or b'"exit"' in self._status.data
        _drain(outputs)  # what it printed before its reply is already in the pipes
        stdout, stderr = (bytes(sink.data).decode("utf-8", "replace") for sink in outputs.values())
        frame = _frame(reply.data)
        truncated = any(sink.is_truncated for sink in outputs.values())
        if frame is None:  # timeout, crash, or a broken protocol: the live process is over
            self._end_live_process()
            status = Status.TIMEOUT if time.monotonic() >= deadline else Status.NONZERO_EXIT
            return SessionResult(status, stdout, stderr, 0.0, restarted=True)
        self._reply = frame
        status = Status.OUTPUT_LIMIT if truncated else Status.OK if frame.get("ok") else Status.NONZERO_EXIT
        return SessionResult(status, stdout, stderr, 0.0, error=frame.get("error"))

    def _end_live_process(self) -> None:
        worker = self._worker()
        worker.kill_job()
        if self._pipes is not None:
            for fd in (self._pipes.stdout, self._pipes.stderr, self._pipes.report,
                       self._pipes.status, self._pipes.stdin):  # fmt: skip
                if fd is not None:
                    os.close(fd)
        self._pipes = None

    def _worker(self):
        assert self._slot is not None and self._slot.worker is not None
        return self._slot.worker

    def _close_locked(self) -> None:
        self._disarm()
        if self._slot is None:
            return
        if self._pipes is not None and self._slot.worker is not None:
            self._end_live_process()
        slot, self._slot = self._slot, None
        self._pool.give_back(slot)

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


def _frame(data: bytearray) -> dict[str, object] | None:
    """The first complete reply frame in `data`, parsed (untrusted JSON), or None."""
    if len(data) < 8:
        return None
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 + size:
        return None
    try:
        value = json.loads(bytes(data[8:8 + size]))
    except (ValueError, RecursionError):  # garbage, or nesting built to break the parser
        return {"ok": False, "error": "malformed reply from the live process"}
    return value if isinstance(value, dict) else {"ok": False, "error": "malformed reply"}


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write `data` to a pipe without blocking past `deadline`; False if it could not."""
    view = memoryview(data)
    os.set_blocking(fd, False)
    while view:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0 or not select.select([], [fd], [], remaining_s)[1]:
            return False
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            return False
    return True


def _drain(outputs: dict[int, CappedSink]) -> None:
    """Read what is already in the pipes (bounded: a daemon may keep writing)."""
    for fd, sink in outputs.items():
        for _ in range(64):
            if not select.select([fd], [], [], 0)[0]:
                break
            chunk = os.read(fd, READ_CHUNK_BYTES)
            if not chunk:
                break
            sink.feed(chunk)
