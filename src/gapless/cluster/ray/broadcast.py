"""Weights to generator replicas over a torch.distributed broadcast group
(`cluster.weight_transport = 'broadcast'`, Ray placement): gloo on CPU, NCCL when the weights are
on CUDA.

    trainer: publish(state, v) ──copy──> staging[free half]              (the trainer's blocking part: one memory copy)
    relay thread (group rank 0): op n = {version v, nbytes, digest, checksum, epoch} in the TCPStore
                                 ──broadcast(staging half)──> every member; waits for ack/n/<member> from each
    replica's receiver thread: reads op n ──broadcast──> landing[unpublished half] ──check──> flip, ack
    replica's generator: fetch_into(load) reads landing[published half] between decode steps

The store is a TCPStore on the trainer's node, listening on a socket bound to a free port (its
file descriptor goes to the store, so nothing rebinds it); the address travels to the replicas in
their weight handle, through the placement. The store holds a numbered log of operations: `group`
(an epoch and its members, in rank order) and `version` (one broadcast of one packed buffer, in
an epoch). A replica says hello, learns at which op its first group starts, and follows the log.

Membership. A broadcast group cannot lose a member, so the relay rebuilds it: a replica that
joins (a replacement) or is evicted (`drop`, from the placement's kill) makes the relay write a new
`group` op and build a new group of the members it has, then re-send the newest version (members
ignore a version they hold). Each member answers every version in the store: `flipped`, `held`
(it had it) or `failed` (its collective raised or timed out, or the checksum did not match). A
member that does not answer within twice `cluster.op_timeout_s` (its own wait in the collective
is bounded by one) is dropped, and the relay rebuilds without it and re-sends; members that
answered `failed` are alive and stay in the rebuilt group. So a dead member costs the others
about one op timeout of relay time. A dropped replica that is still alive finds itself missing
from the next group and stops with an error (the pipeline evicts it). The relay gives up, and the
next `publish` raises, only when no group gets a version through within
`cluster.rendezvous_timeout_s`; the error names who waited for whom.

Guaranteed: the trainer never waits for a replica or the network (`publish` copies into the
staging half the relay is not sending; it waits at most for one broadcast of the other half);
versions a replica exposes are monotonic (one not newer than what it holds is ignored) and never
torn (a version lands in the unpublished half and is flipped to only after the collective
returned without error, the op's size and digest match the replica's layout and the landed
bytes' checksum matches the sender's; a failed or
timed-out collective leaves that half unpublished); no wait is unbounded (joining: rendezvous
timeout; each collective and each ack: op timeout). Not guaranteed: that a replica sees every
version (it gets the newest at each send); NCCL (the code path exists, untested on this CPU box);
gloo's root sends each receiver its own copy, so a send costs about R times one (bench/distributed.py).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from gapless.cluster.ranks import Rendezvous
from gapless.cluster.ray.weights import Layout, RelayedWeights, StagedPublish

POLL_S = 0.2  # how often a waiting side looks again (store waits are short and repeated)
KEY_PAUSE_MAX_S = 0.01  # the longest pause between two looks for a store key: the relay's latency grain


class RelayTimeout(TimeoutError):
    """A bounded wait of the weight relay ran out; the message names who waited for whom."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _group(store, epoch: int, rank: int, size: int, host: str, timeout_s: float, cuda: bool):
    prefixed = dist.PrefixStore(f"epoch{epoch}/", store)
    if cuda:  # pragma: no cover - needs CUDA devices
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _td(timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _td(timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, size, options)


def _wait_key(store, key: str, timeout_s: float, stopped: Callable[[], bool] = lambda: False) -> bool:
    """Wait up to `timeout_s` for `key` in the store, in short waits; False past it or when stopped."""
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while not stopped():
        if store.check([key]):  # (store.wait would log every short timeout)
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, KEY_PAUSE_MAX_S)
    return False


def checksum(flat: torch.Tensor) -> int:
    """The packed buffer's 64-bit words summed (wrapping): computed by the sender before a send and
    checked by the receiver before the flip (catches a partial or garbled landing, not every
    permutation of words)."""
    return int(flat.view(torch.int64).sum().item())


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"


class BroadcastSender(StagedPublish):
    """The trainer's side: a two-half staging buffer, the store and the relay thread (rank 0)."""

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        op_timeout_s: float,
        rendezvous_timeout_s: float,
        host: str | None = None,
        log=print,
    ):
        self.layout = Layout(state)
        self.op_timeout_s, self.rendezvous_timeout_s, self.log = op_timeout_s, rendezvous_timeout_s, log
        self.cuda = any(t.is_cuda for t in state.values())
        self.host = host or _node_ip()
        rendezvous, self.store = Rendezvous.serve(self.host, rendezvous_timeout_s)
        self.port = rendezvous.port
        self.halves = [torch.empty(self.layout.nbytes, dtype=torch.uint8) for _ in range(2)]
        self.views = [self.layout.views(h) for h in self.halves]
        self.locks = [threading.Lock(), threading.Lock()]
        self.held = [-1, -1]
        self.version = -1  # newest published
        self.relayed = -1  # newest acknowledged by every member of the current group
        self.relay_s: list[tuple[int, float]] = []  # (version, seconds from publish to every ack)
        self.dropped: list[tuple[str, str]] = []  # (member, why) the relay left out of its group
        self.sums: dict[int, int] = {}  # version -> checksum of what was sent
        self.flips: dict[str, list[int]] = {}  # member -> versions it acknowledged flipping to, in order
        self.epochs = 0
        self.groups: list[list[str]] = []  # the members of each epoch's group, in order
        self.error: BaseException | None = None
        self._expected: dict[str, float] = {}  # member -> when the placement made its handle
        self._members: list[str] = []  # of the current group, ranks 1..
        self._drop: set[str] = set()
        self._news = threading.Condition()
        self._published_at: dict[int, float] = {}
        self._closed = False
        self._op = 0
        self._pg = None
        self._thread = threading.Thread(target=self._relay, name="weight-broadcast", daemon=True)
        self._thread.start()

    # ---- the trainer's calls -------------------------------------------------------------------
    def expect(self, member: str) -> None:
        with self._news:
            self._expected[member] = time.monotonic()
            self._news.notify_all()

    def drop(self, member: str) -> None:
        """The placement evicted `member`: the next send goes to a group without it."""
        with self._news:
            self._expected.pop(member, None)
            if member in self._members:
                self._drop.add(member)
            self._news.notify_all()

    def wait_relayed(self, version: int, timeout_s: float) -> bool:
        with self._news:
            return self._news.wait_for(lambda: self.relayed >= version or self.error is not None, timeout_s)

    def close(self) -> None:
        """Stop the relay, after it sent the newest version (bounded by the op timeout, so that the
        replicas end on the trainer's last weights when they are still there to take them)."""
        if self._members:
            self.wait_relayed(self.version, min(self.op_timeout_s, 10.0))
        with self._news:
            self._closed = True
            self._news.notify_all()
        self._thread.join(timeout=self.op_timeout_s + 1)
        if not self._thread.is_alive():  # the group and the store go now, not in interpreter teardown
            self._pg = None
            self.store = None

    # ---- the relay thread ----------------------------------------------------------------------
    def _put_op(self, op: dict) -> int:
        n = self._op
        self.store.set(f"op/{n}", json.dumps(op))
        self._op += 1
        return n

    def _joined(self) -> list[str]:
        """Expected members that said hello."""
        with self._news:
            expected = list(self._expected)
        return [m for m in expected if m not in self._members and self.store.check([f"hello/{m}"])]

    def _rebuild(self, members: list[str]) -> list[str]:
        """A new group of `members`; returns those that did not join it within the op timeout."""
        epoch = self.epochs = self.epochs + 1
        self._pg = None
        self._members = list(members)
        self.groups.append(list(members))
        n = self._put_op({"kind": "group", "epoch": epoch, "members": members})
        for m in members:
            self.store.set(f"start/{m}", str(n))
        if not members:
            return []
        try:
            self._pg = _group(self.store, epoch, 0, len(members) + 1, self.host, self.op_timeout_s, self.cuda)
            return []
        except Exception as exc:  # noqa: BLE001 - a member that does not join within the op timeout
            self.log(f"warning: weight broadcast group {epoch} not formed: {exc}")
            missing = [m for m in members if not self.store.check([f"epoch{epoch}/in/{m}"])]
            return missing or list(members)

    def _send(self, half: int) -> tuple[list[str], list[str]]:
        """One version to the current group; returns (members that did not answer, members whose
        collective failed). A member answers within twice the op timeout: its own wait in the
        collective is bounded by one, so a live member whose collective failed (a peer died)
        says so instead of being taken for the dead one."""
        version = self.held[half]
        total = self.sums[version] = checksum(self.halves[half])
        n = self._put_op(
            {
                "kind": "version",
                "epoch": self.epochs,
                "version": version,
                "checksum": total,
                "nbytes": self.layout.nbytes,
                "digest": self.layout.digest,
            }
        )
        buf = self.halves[half].cuda() if self.cuda else self.halves[half]
        try:
            self._pg.broadcast([buf], dist.BroadcastOptions()).wait()
        except Exception as exc:  # noqa: BLE001 - a member died or stalled: who did not answer says which
            self.log(f"warning: weight broadcast of version {version} failed: {exc}")
        deadline = time.monotonic() + 2 * self.op_timeout_s
        for m in self._members:
            _wait_key(self.store, f"ack/{n}/{m}", max(0.0, deadline - time.monotonic()))
        answers = {m: self.store.get(f"ack/{n}/{m}") for m in self._members if self.store.check([f"ack/{n}/{m}"])}
        for m, answer in answers.items():
            if answer == b"flipped":
                self.flips.setdefault(m, []).append(version)
        return [m for m in self._members if m not in answers], [m for m, a in answers.items() if a == b"failed"]

    def report(self) -> dict:
        """What the relay did: written to the run directory as relay.json."""
        return {
            "transport": "broadcast",
            "backend": "nccl" if self.cuda else "gloo",
            "epochs": self.epochs,
            "groups": self.groups,
            "dropped": self.dropped,
            "flips": self.flips,
            "checksums": {str(v): c for v, c in self.sums.items()},
            "relay_s": self.relay_s,
            "published": self.version,
            "error": repr(self.error) if self.error else None,
        }

    def _relay(self) -> None:
        try:
            sent = -1  # newest version sent to the current group
            failing_since: float | None = None
            while True:
                with self._news:
                    self._news.wait_for(  # joins are polled every POLL_S
                        lambda: self._closed or self._drop or self._pg is not None and self.version > sent, POLL_S
                    )
                    if self._closed:
                        return
                    drop, self._drop = self._drop, set()
                joined = self._joined()
                members = [m for m in self._members if m not in drop] + joined
                missing: list[str] = []
                if drop or joined or self._pg is None and members:
                    missing = self._rebuild(members)
                    sent = -1  # the newest version goes to the new group, members ignore what they hold
                now = time.monotonic()
                with self._news:
                    expected = list(self._expected.items())
                for m, since in expected:
                    if m not in self._members and now - since > self.rendezvous_timeout_s:
                        raise RelayTimeout(
                            f"the trainer's weight relay waited {self.rendezvous_timeout_s:g} s "
                            f"(cluster.rendezvous_timeout_s) for {m} to join the broadcast group"
                        )
                version, failed = self.version, []
                if not missing:
                    if self._pg is None or self.version <= sent:
                        continue
                    half = 0 if self.held[0] > self.held[1] else 1
                    with self.locks[half]:
                        version = self.held[half]
                        missing, failed = self._send(half)
                if failed and not missing:  # every member alive, the collective failed: the same group again
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.rendezvous_timeout_s:
                        raise RelayTimeout(
                            f"the trainer's weight relay failed to broadcast version {version} to "
                            f"{', '.join(failed)} for {self.rendezvous_timeout_s:g} s "
                            "(cluster.rendezvous_timeout_s)"
                        )
                    self._pg, sent = None, -1
                    continue
                if missing:
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.rendezvous_timeout_s:
                        raise RelayTimeout(
                            f"the trainer's weight relay waited for {', '.join(missing)} to acknowledge "
                            f"version {version} for {self.rendezvous_timeout_s:g} s "
                            "(cluster.rendezvous_timeout_s)"
                        )
                    why = (
                        f"did not join the group or answer for version {version} within 2 x {self.op_timeout_s:g} s "
                        "(cluster.op_timeout_s)"
                    )
                    with self._news:
                        for m in missing:
                            self.dropped.append((m, why))
                            self._expected.pop(m, None)
                    self.log(f"warning: weight relay: {', '.join(missing)} {why}; rebuilding the group without them")
                    self._pg, self._members = None, [m for m in self._members if m not in missing]
                    sent = -1
                    continue
                failing_since = None
                sent = version
                with self._news:
                    self.relayed = max(self.relayed, version)
                    self.relay_s.append(
                        (version, time.perf_counter() - self._published_at.pop(version, time.perf_counter()))
                    )
                    self._news.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported on the next publish
            self.error = exc
            with self._news:
                self._news.notify_all()


class BroadcastWeights(RelayedWeights):
    """One replica's weights: on the trainer, a handle on the shared sender (SharedWeights.publish's
    signature); pickled into the replica's actor, a group member with SharedWeights.fetch_into's."""

    def __init__(self, sender: BroadcastSender, member: str = ""):
        """`member`: the replica's name; set (and passed to `sender.expect`) before the handle is sent."""
        self.sender, self.member = sender, member
        self.layout, self.host, self.port = sender.layout, sender.host, sender.port
        self.op_timeout_s, self.first_timeout_s, self.cuda = (
            sender.op_timeout_s,
            sender.rendezvous_timeout_s,
            sender.cuda,
        )

    # ---- the replica's side --------------------------------------------------------------------
    def __getstate__(self):
        return {
            k: getattr(self, k) for k in ("member", "layout", "host", "port", "op_timeout_s", "first_timeout_s", "cuda")
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._buffers()
        self._closed = False

    def _first_timeout(self) -> TimeoutError:
        return RelayTimeout(
            f"{self.member} waited {self.first_timeout_s:g} s (cluster.rendezvous_timeout_s) "
            "for its first weights from the trainer's broadcast group"
        )

    def _receive(self) -> None:
        try:
            store = dist.TCPStore(self.host, self.port, None, False, _td(self.first_timeout_s), use_libuv=False)
            store.set(f"hello/{self.member}", str(os.getpid()))
            if not _wait_key(store, f"start/{self.member}", self.first_timeout_s, lambda: self._closed):
                raise RelayTimeout(
                    f"{self.member} waited {self.first_timeout_s:g} s (cluster.rendezvous_timeout_s) "
                    f"for the trainer's weight relay to admit it to the broadcast group"
                )
            n, pg, epoch, rank = int(store.get(f"start/{self.member}")), None, -1, -1
            while not self._closed:
                if not _wait_key(store, f"op/{n}", 3600.0, lambda: self._closed):
                    return
                op = json.loads(store.get(f"op/{n}"))
                if op["kind"] == "group":
                    pg = None
                    if self.member not in op["members"]:
                        raise RuntimeError(
                            f"the trainer's weight relay left {self.member} out of broadcast group "
                            f"{op['epoch']} (it did not answer for a version within 2 x cluster.op_timeout_s)"
                        )
                    epoch, rank = op["epoch"], op["members"].index(self.member) + 1
                    store.set(f"epoch{epoch}/in/{self.member}", "1")
                    try:
                        pg = _group(store, epoch, rank, len(op["members"]) + 1, self.host, self.op_timeout_s, self.cuda)
                    except Exception:  # noqa: BLE001 - a member missing: the relay rebuilds, the next op says how
                        pg = None
                elif op["epoch"] == epoch and pg is not None:
                    self._land(store, pg, op, n)
                n += 1
        except BaseException as exc:  # noqa: BLE001 - raised in the generator by the next fetch
            with self._meta:
                self.error = exc
                self._meta.notify_all()

    def _land(self, store, pg, op: dict, n: int) -> None:
        version = op["version"]
        if op["digest"] != self.layout.digest or op["nbytes"] != self.layout.nbytes:
            raise RuntimeError(
                f"weight version {version} has layout {op['digest'][:8]} of {op['nbytes']} bytes; this "
                f"replica expects {self.layout.digest[:8]} of {self.layout.nbytes} bytes"
            )
        target = 1 - self.current
        with self.locks[target]:  # the unpublished half: no reader holds it
            buf = (
                torch.empty(self.layout.nbytes, dtype=torch.uint8, device="cuda") if self.cuda else self.halves[target]
            )
            try:
                pg.broadcast([buf], dist.BroadcastOptions()).wait()
                if self.cuda:  # pragma: no cover - needs CUDA devices
                    self.halves[target].copy_(buf)
                whole = checksum(self.halves[target]) == op["checksum"]
            except Exception:  # noqa: BLE001 - a peer died or stalled (bounded by the op timeout)
                whole = False
            if not whole:  # torn: the half stays unpublished; the relay rebuilds the group and re-sends
                self.held[target] = -1
                store.set(f"ack/{n}/{self.member}", "failed")
                return
            self.held[target] = version
        with self._meta:
            flipped = version > self._version
            if flipped:
                self.current, self._version = target, version
            self._meta.notify_all()
        store.set(f"ack/{n}/{self.member}", "flipped" if flipped else "held")
