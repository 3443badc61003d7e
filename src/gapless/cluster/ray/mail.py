"""Ray placement's stand-ins for the pipeline's shared-memory primitives: channels, the stop flag
and heartbeats, all carried by one mailbox actor on the trainer's node.

    writer process                      PostOffice (async actor, trainer's node)        reader process
    put(item) ─> local list ─flusher─> put_many(box, [items]) ─> box ─> get_many(box) ─prefetch─> local queue ─> get()
    beat(name) ─> counter ─pusher (0.2 s)─> beats{name: (count, host, pid, marks, what)} <─poller (0.2 s)─ trainer: age_s(name)
    progress(name, what) ─> marks, what ─┘                                       progress_age_s(name), last_progress(name)
    trainer: stop.set() ─> stop = True ─> long poll ─> every actor: stop.is_set() (a local read)

A multiprocessing queue, lock or shared array cannot be pickled into a Ray actor, and one Ray call
costs milliseconds (a queue round trip is ~13 ms on this 2-core box, against ~0.3 ms for an
`mp.Queue`), so every object here keeps the hot operation local (put, get, is_set, beat, age_s
cost no Ray call) and a background thread per object and process moves *batches*: whatever was
put since the last flush goes in one call, and a reader takes everything waiting in one call.

The mailbox holds each item as the bytes its writer pickled and never unpickles one: otherwise
Ray's deserialisation of the first message in the mailbox process would import gapless and torch
there, in its event loop, and answer no call meanwhile (seen: over 40 s on a loaded 2-core box,
every actor's calls timing out at once).

Guaranteed: each channel is FIFO and exactly-once for its one writer and one reader (the flusher
waits for each batch's acknowledgement before sending the next); a slow mailbox is not a gone
one: a call that times out (CALL_TIMEOUT_S; seen at 30 s on a 2-core box under load) is made
again, never the end of its thread, and repeating one loses and duplicates nothing (a batch
carries a sequence number the mailbox puts once; a read names how many items the reader holds,
which acknowledges them, and items leave the mailbox only when acknowledged; the stop flag's
poll reads a value); a bounded channel (maxsize > 0) holds at most
three times maxsize items in all (writer list, mailbox, reader queue), so a writer still feels
back-pressure (`put` raises queue.Full at its timeout); every Ray call is bounded by a timeout;
`flush_writers` waits until what this process put has reached the mailbox (an actor calls it
before its main function returns, so its last words arrive); an item the reader cannot unpickle
(two nodes running different code) makes its `get` raise ChannelError, in order, and the items
after it still arrive; once the mailbox actor is dead (Ray's memory monitor, a lost node) every
`get` raises MailboxLost with Ray's reason instead of waiting for items that cannot come.
Heartbeat and progress ages are measured on the trainer's clock, from when it saw a beat or a
progress mark change, so clocks of other machines do not matter; an age is up to ~0.5 s older than
on the local placement (push and poll periods); time in which the mailbox answered no read (a
stalled Ray, a starved trainer) is not counted as any actor's silence nor as its lack of progress; `quiesce` (before
ray.shutdown) waits until no call of this process is inside ray.get. Not guaranteed: a pid
for an actor on another host (`pid` returns 0 there, which the stall watch reads as "starting");
delivery after the mailbox actor died (the run is then failing anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import queue
import socket
import threading
import time
import uuid
from collections import deque
from typing import Any

import ray

from gapless.cluster.ray.deaths import death_reason
from gapless.cluster.watchdog import Progress, beating
from gapless.errors import InfrastructureError

CALL_TIMEOUT_S = 30.0  # the longest any one mailbox call may take (each long poll asks for much less)
POLL_S = 0.5  # a long poll's wait for news, in the mailbox
PUSH_S = 0.2  # heartbeat push and poll period
HOST = socket.gethostname()


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=10_000)
class PostOffice:
    """Boxes of items (one writer, one reader each), the run's stop flag and heartbeats."""

    def __init__(self):
        self.boxes: dict[str, deque] = {}
        self.first: dict[str, int] = {}  # box -> the channel index of its first item (items before were acknowledged)
        self.batches: dict[str, int] = {}  # box -> the sequence number of the last batch put
        self.changed: asyncio.Condition | None = None
        self.stop = False
        self.beats: dict[str, tuple] = {}  # actor -> (beats, host, pid, progress marks, what)

    def _cond(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def put_many(self, box: str, batch: int, items: list, maxsize: int, wait_s: float) -> bool:
        """Append batch number `batch` once the box has room (maxsize 0: always); False after
        `wait_s` without. A batch already put (a retry of a call that timed out at the writer but
        went through here) is not appended again."""
        cond = self._cond()
        async with cond:
            q = self.boxes.setdefault(box, deque())
            if batch <= self.batches.get(box, 0):
                return True
            if maxsize > 0:
                try:
                    await asyncio.wait_for(
                        cond.wait_for(lambda: len(q) < maxsize or batch <= self.batches.get(box, 0)), wait_s
                    )
                except asyncio.TimeoutError:
                    return False
                if batch <= self.batches.get(box, 0):
                    return True
            q.extend(items)
            self.batches[box] = batch
            cond.notify_all()
        return True

    async def get_many(self, box: str, have: int, limit: int, wait_s: float) -> list:
        """The items from channel index `have` on (up to `limit`; 0: all), waiting up to `wait_s`
        for the first. `have` (how many items the reader holds) acknowledges every item before it:
        those leave the box now. Items handed out stay until acknowledged, so a call whose answer
        never reached the reader (it timed out there) loses nothing: the next call gets them again."""
        cond = self._cond()
        async with cond:
            q = self.boxes.setdefault(box, deque())
            first = self.first.get(box, 0)
            acknowledged = max(0, min(have - first, len(q)))
            for _ in range(acknowledged):
                q.popleft()
            self.first[box] = first = first + acknowledged
            if acknowledged:
                cond.notify_all()  # room for a waiting writer
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cond.wait_for(lambda: self.first[box] + len(q) > have or self.stop), wait_s)
            start = max(0, have - self.first[box])
            end = len(q) if limit <= 0 else min(len(q), start + limit)
            return [q[i] for i in range(start, end)]

    async def set_stop(self) -> None:
        cond = self._cond()
        async with cond:
            self.stop = True
            cond.notify_all()

    async def wait_stop(self, wait_s: float) -> bool:
        cond = self._cond()
        async with cond:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cond.wait_for(lambda: self.stop), wait_s)
            return self.stop

    async def beat(self, beats: dict[str, tuple]) -> None:
        self.beats.update(beats)

    async def read_beats(self) -> dict[str, tuple]:
        return dict(self.beats)


_calls = threading.Condition()  # guards _in_flight and _closing
_in_flight = 0  # mailbox calls of this process now inside ray.get
_closing = False  # quiesce() ran: no call may start (ray.shutdown is next)


def _call(make_ref, timeout_s: float = CALL_TIMEOUT_S):
    """`make_ref()`'s result, if this process is still connected to Ray: a thread outliving the run's
    connection must end, never start a Ray instance of its own (ray.get's auto-init), and never be
    inside ray.get while ray.shutdown tears the connection down (that crashed the process with
    SIGSEGV at the run's exit); `quiesce` waits for the calls in flight first."""
    global _in_flight
    with _calls:
        if _closing or not ray.is_initialized():
            raise ConnectionError("not connected to Ray (the run ended)")
        _in_flight += 1
    try:
        return ray.get(make_ref(), timeout=timeout_s)
    finally:
        with _calls:
            _in_flight -= 1
            _calls.notify_all()


def _retried(make_ref, timeout_s: float = CALL_TIMEOUT_S, attempts: int = 0):
    """`_call`, again after each timeout (`attempts` calls at most; 0: until one answers). A slow
    mailbox is not a gone one: only its death, the run's end or a Ray error ends the caller. Every
    mailbox call is safe to repeat (put_many and get_many by their batch and index numbers)."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return _call(make_ref, timeout_s)
        except ray.exceptions.GetTimeoutError:
            if attempts and attempt >= attempts:
                raise


def quiesce(timeout_s: float = 2 * POLL_S + 5.0) -> bool:
    """Refuse every further mailbox call of this process and wait (up to `timeout_s`) until none is
    in flight: the background threads then end at their next call. Call it before ray.shutdown.
    True when none was left in flight."""
    global _closing
    with _calls:
        _closing = True
        return _calls.wait_for(lambda: _in_flight == 0, timeout_s)


def reopen() -> None:
    """Allow mailbox calls again: this process has joined Ray anew (quiesce ended the last run's)."""
    global _closing
    with _calls:
        _closing = False


def no_auto_init() -> None:
    """Turn off Ray's implicit ray.init in this process (a call after shutdown must fail, not start Ray)."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


# ---- channels ---------------------------------------------------------------------------------
_writers: list["RayChannel"] = []  # channels this process wrote to (flush_writers)


class ChannelError(RuntimeError):
    """An item reached this process but cannot be unpickled here (different code on two nodes)."""


class MailboxLost(InfrastructureError):
    """The run's mailbox actor died (its reason from Ray, cluster/ray/deaths.py): no channel delivers any more."""


class _Lost:
    """Left in the reader's queue once the mailbox is gone: every later `get` raises MailboxLost."""

    def __init__(self, why: str):
        self.why = why


class _Undeliverable:
    """Stands in the reader's queue for an item that could not be unpickled: `get` raises there."""

    def __init__(self, why: str):
        self.why = why


def flush_writers(timeout_s: float = 10.0) -> None:
    """Wait until everything this process put has reached the mailbox (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    for channel in list(_writers):
        channel.flush(max(0.0, deadline - time.monotonic()))


class RayChannel:
    """A queue between two processes anywhere in the cluster: `put` / `get` / `get_nowait` with the
    semantics the actors expect of a multiprocessing queue (queue.Full, queue.Empty, timeouts)."""

    def __init__(self, office, maxsize: int = 0):
        self.office, self.maxsize, self.box = office, maxsize, uuid.uuid4().hex
        self._local()

    def __getstate__(self):
        return {"office": self.office, "maxsize": self.maxsize, "box": self.box}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local()

    def _local(self) -> None:
        self._lock = threading.Condition()
        self._pending: list = []
        self._in_flight = 0
        self._batch = 0  # sequence number of the last batch sent (writer)
        self._have = 0  # items received so far (reader): the index of the next one
        self._flusher: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._received: queue.Queue = queue.Queue(self.maxsize)

    # writer side
    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        with self._lock:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name=f"ray-put-{self.box[:6]}", daemon=True)
                self._flusher.start()
                _writers.append(self)
            if self.maxsize > 0 and not self._lock.wait_for(
                lambda: len(self._pending) < self.maxsize, timeout if block else 0
            ):
                raise queue.Full
            self._pending.append(item)
            self._lock.notify_all()

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending)
                items, self._pending = self._pending, []
                self._in_flight = len(items)
                self._lock.notify_all()  # room for a blocked put
            self._batch += 1
            blobs = None
            try:
                blobs = [pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL) for item in items]
                while not _retried(
                    lambda: self.office.put_many.remote(self.box, self._batch, blobs, self.maxsize, POLL_S)
                ):
                    pass  # the box is full: the reader is behind (back-pressure)
            except BaseException:  # noqa: BLE001 - Ray raises SystemExit in threads after shutdown
                return  # the mailbox is gone: the run is over
            finally:
                # no reference outlives the send: a thread that frees tensors while the interpreter
                # exits aborts it (the last batch would otherwise be freed by the next wake-up)
                items = blobs = None
                with self._lock:
                    self._in_flight = 0
                    self._lock.notify_all()

    def flush(self, timeout_s: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._in_flight, timeout_s)

    # reader side
    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name=f"ray-get-{self.box[:6]}", daemon=True)
            self._reader.start()
        item = self._received.get(block, timeout)
        if isinstance(item, _Undeliverable):
            raise ChannelError(item.why)
        if isinstance(item, _Lost):
            self._received.put(item)
            raise MailboxLost(f"channel {self.box[:8]} cannot deliver: the run's mailbox {item.why}")
        return item

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def _read_loop(self) -> None:
        while True:
            try:
                items = _retried(lambda: self.office.get_many.remote(self.box, self._have, self.maxsize, POLL_S))
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
                self._received.put(_Lost(death_reason(exc)))  # the reader hears why, instead of queue.Empty forever
                return
            except BaseException:  # noqa: BLE001 - Ray raises SystemExit in threads after shutdown
                return
            self._have += len(items)
            for blob in items:
                try:
                    item = pickle.loads(blob)
                except Exception as exc:  # noqa: BLE001 - whatever the bytes raise, the reader must hear of it
                    item = _Undeliverable(
                        f"a message on channel {self.box[:8]} cannot be unpickled in this process ({type(exc).__name__}: "
                        f"{exc}); every node of the cluster must run the same gapless, torch and Python versions"
                    )
                self._received.put(item)  # blocks when the reader is maxsize behind


# ---- the stop flag ----------------------------------------------------------------------------
class RayStopFlag:
    """StopFlag's interface (set / is_set / wait); is_set reads a value a poller keeps current."""

    def __init__(self, office):
        self.office = office
        self._local()

    def __getstate__(self):
        return {"office": self.office}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local()

    def _local(self) -> None:
        self._set = threading.Event()
        self._poller: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def set(self) -> None:
        self._set.set()
        with contextlib.suppress(BaseException):
            _retried(lambda: self.office.set_stop.remote(), 5.0, attempts=3)

    def _watch(self) -> None:
        with self._start_lock:
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, name="ray-stop", daemon=True)
                self._poller.start()

    def _poll(self) -> None:
        while not self._set.is_set():
            try:
                if _retried(lambda: self.office.wait_stop.remote(POLL_S)):
                    self._set.set()
            except BaseException:  # noqa: BLE001 - Ray raises SystemExit in threads after shutdown
                self._set.set()  # the mailbox is gone: the trainer has gone, so stop
                return

    def is_set(self) -> bool:
        self._watch()
        return self._set.is_set()

    def wait(self, timeout_s: float) -> bool:
        self._watch()
        return self._set.wait(timeout_s)


# ---- heartbeats -------------------------------------------------------------------------------
class RayHeartbeats:
    """watchdog.Heartbeats' interface. An actor's beats bump a local counter, its progress marks
    another (with what the last one was about), which a pusher thread sends every PUSH_S when they
    changed; the trainer's poller records when it saw each change."""

    def __init__(self, office, actors: tuple[str, ...]):
        self.office, self.actors = office, tuple(actors)
        self._local()

    def __getstate__(self):
        return {"office": self.office, "actors": self.actors}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local()

    def _local(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[str, int] = {}
        self._own: dict[str, float] = {}  # beats of this process's actors, on its clock
        self._marks: dict[str, tuple[int, str]] = {}  # progress of this process's actors: (marks, what)
        self._own_progress: dict[str, float] = {}  # when each last progressed, on this process's clock
        self._seen: dict[str, tuple[tuple, float]] = {}  # actor -> (last record seen, when)
        self._progress_seen: dict[str, tuple[int, str, float]] = {}  # actor -> (marks, what, when they changed)
        self._pids: dict[str, int] = {}
        self._before_start: dict[str, tuple] = {}
        self._threads: dict[str, threading.Thread] = {}
        now = time.monotonic()
        for actor in self.actors:
            self._seen[actor] = ((), now)
            self._progress_seen[actor] = (0, "", now)
        self._read_at = now  # when the mailbox last answered a read of the beats

    def _thread(self, name: str, target) -> None:
        with self._lock:
            if name not in self._threads:
                self._threads[name] = threading.Thread(target=target, name=f"ray-{name}", daemon=True)
                self._threads[name].start()

    def register(self, actor: str) -> None:
        self._pids[actor] = os.getpid()
        self.beat(actor)

    def beat(self, actor: str) -> None:
        self._count[actor] = self._count.get(actor, 0) + 1
        self._own[actor] = time.monotonic()
        self._thread("beats-push", self._push)

    def progress(self, actor: str, what: str) -> None:
        """watchdog.Heartbeats.progress: a local record; the pusher sends the newest."""
        self._marks[actor] = (self._marks.get(actor, (0, ""))[0] + 1, what)
        self._own_progress[actor] = time.monotonic()
        if "beats-push" not in self._threads:
            self._thread("beats-push", self._push)

    def _push(self) -> None:
        sent: dict[str, tuple] = {}
        while True:
            records = {
                a: (n, HOST, self._pids.get(a, os.getpid()), *self._marks.get(a, (0, "")))
                for a, n in list(self._count.items())
            }
            changed = {a: record for a, record in records.items() if sent.get(a) != record}
            if changed:
                try:
                    _call(lambda: self.office.beat.remote(changed), 5.0)
                except ray.exceptions.GetTimeoutError:
                    continue  # the mailbox is slow, not gone: send the newest counts again
                except BaseException:  # noqa: BLE001 - Ray raises SystemExit in threads after shutdown
                    return
                sent.update(changed)
            time.sleep(PUSH_S)

    def _read(self) -> None:
        beats = _call(lambda: self.office.read_beats.remote(), 5.0)
        now = time.monotonic()
        blind_s = now - self._read_at - 2 * PUSH_S  # the mailbox answered no read, so no beat could land
        self._read_at = now
        for actor, (record, seen) in list(self._seen.items()):
            if record != beats.get(actor, record):
                self._seen[actor] = (beats[actor], now)
            elif blind_s > 0:  # a stall of the mailbox is no silence of the actors: it does not count
                self._seen[actor] = (record, min(now, seen + blind_s))
            marks, what, at = self._progress_seen[actor]
            new_marks, new_what = _marks_of(self._seen[actor][0])
            if new_marks != marks:
                self._progress_seen[actor] = (new_marks, new_what, now)
            elif blind_s > 0:  # nor is it their lack of progress
                self._progress_seen[actor] = (marks, what, min(now, at + blind_s))

    def _poll(self) -> None:
        while True:
            time.sleep(PUSH_S)
            try:
                self._read()
            except ray.exceptions.GetTimeoutError:
                continue  # slow, not gone: the blind time is credited at the next answer
            except BaseException:  # noqa: BLE001 - Ray raises SystemExit in threads after shutdown
                return

    def _watch(self) -> None:
        """The trainer's side: the first call reads the beats now, then a poller keeps them current."""
        if "beats-poll" not in self._threads:
            with contextlib.suppress(BaseException):
                self._read()
            self._thread("beats-poll", self._poll)

    def starting(self, actor: str) -> None:
        """`actor` is being started now: its start-up allowance starts now, and its pid is unknown
        until it beats (the record seen so far belongs to no live process)."""
        record, now = self._seen[actor][0], time.monotonic()
        self._before_start[actor] = record
        self._seen[actor] = (record, now)
        self._progress_seen[actor] = (*self._progress_seen[actor][:2], now)

    def beating(self, actor: str, every_s: float = 0.2):
        return beating(lambda: self.beat(actor), actor, every_s)

    def age_s(self, actor: str) -> float:
        self._watch()
        last = max(self._seen[actor][1], self._own.get(actor, 0.0))
        return time.monotonic() - last

    def pid(self, actor: str) -> int:
        """The actor's pid when it runs on this host and has beaten since it (re)started, else 0."""
        if actor in self._pids:
            return self._pids[actor]
        self._watch()
        record = self._seen[actor][0]
        if not record or record == self._before_start.get(actor):
            return 0
        host, pid = record[1], record[2]
        return pid if host == HOST else 0

    def progress_age_s(self, actor: str) -> float:
        self._watch()
        last = max(self._progress_seen[actor][2], self._own_progress.get(actor, 0.0))
        return time.monotonic() - last

    def last_progress(self, actor: str) -> Progress:
        self._watch()
        marks, what, at = self._progress_seen[actor]
        if self._own_progress.get(actor, 0.0) > at:  # an actor of this process
            (marks, what), at = self._marks[actor], self._own_progress[actor]
        return Progress(marks, time.monotonic() - at, what)


def _marks_of(record: tuple) -> tuple[int, str]:
    """(marks, what) of a heartbeat record (count, host, pid, marks, what); (0, "") before any."""
    return (record[3], record[4]) if len(record) >= 5 else (0, "")
