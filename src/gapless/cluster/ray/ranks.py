"""The trainer's data-parallel ranks 1..W-1 as Ray actors (cluster.placement = 'ray').

    gapless train (driver: trainer rank 0, the TCP store on a free port of its node)
        ├── trainer-rank1 ── an _ActorHost on bundle R+1 of the run's placement group
        └── ...              runs dp_rank.rank_main, as a local rank process does
    records: rank 0 ──RayChannel──> each rank's inbox; each rank ──its own RayChannel──> rank 0

The rank code, the records and the GRPO step are the ones of the local ranks (trainer/dp_rank.py);
only the process, the queues and the rendezvous differ (cluster/ranks.py). The ranks meet in
a TCPStore that rank 0 serves on a socket it bound to a free port of its node (no fixed port;
nothing is closed and rebound), and gloo connects them over the network.

Guaranteed: a rank that dies (SIGKILL, OOM, its node lost) is named within a poll of rank 0's
(its `run` call fails); one that raised is named with its traceback (its last words are awaited
for up to RAISED_GRACE_S); a rank stopped with SIGSTOP is named at once when it runs on the
trainer's host, else when its collective times out (cluster.op_timeout_s); `close` kills every
rank actor, and the placement's teardown does too. Not guaranteed: that gloo finds a route
between nodes by itself (set GLOO_SOCKET_IFNAME on multi-homed nodes).
"""

from __future__ import annotations

import queue
import socket
import time
from typing import Any, Callable, Protocol

import ray

from gapless.cluster.names import rank_name
from gapless.cluster.ranks import Rendezvous, stopped_or_gone
from gapless.config import ClusterConfig

RAISED_GRACE_S = 1.0  # how long a rank whose run raised may take to deliver its traceback
STOP_GRACE_S = 5.0  # how long a rank may take to leave the group after Stop


class RankHome(Protocol):
    """What the ranks need of the placement that hosts them (RayPlacement): its bundles and channels."""

    private: bool  # a Ray instance of this run alone, on this machine
    cluster: ClusterConfig
    rank_hosts: dict[str, Any]  # actor name -> its _ActorHost, killed at teardown

    @property
    def closed(self) -> bool: ...

    def channel(self, maxsize: int = 0) -> Any: ...

    def rank_bundle(self, rank: int) -> int: ...

    def place(self, bundle: int, main: Callable[[Any], None], spec: Any) -> tuple[Any, Any]: ...


class RayRanks:
    kind = "ray"

    def __init__(self, placement: RankHome):
        self.placement = placement
        host = "127.0.0.1" if placement.private else ray.util.get_node_ip_address()
        self.rendezvous, self._master = Rendezvous.serve(host, placement.cluster.rendezvous_timeout_s)
        self._outboxes: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}  # rank -> ObjectRef of its run()
        self._located: dict[int, tuple[str, int]] = {}  # rank -> (host name, pid), from its Ready record
        self._raised_at: dict[int, float] = {}

    def store(self, world_size: int, timeout_s: float):
        return self._master

    def channel(self):
        return self.placement.channel()

    def outbox(self, rank: int):
        self._outboxes[rank] = self.placement.channel()  # one writer per channel: one per rank
        return self._outboxes[rank]

    def start(self, rank: int, main: Callable[[Any], None], spec: Any) -> None:
        host, self.runs[rank] = self.placement.place(self.placement.rank_bundle(rank), main, spec)
        self.placement.rank_hosts[rank_name(rank)] = host

    def receive(self, wait_s: float) -> list:
        deadline = time.monotonic() + wait_s
        while True:
            out = []
            for outbox in self._outboxes.values():
                while True:
                    try:
                        out.append(outbox.get_nowait())
                    except queue.Empty:
                        break
            for message in out:
                if getattr(message, "pid", 0):  # Ready: where the rank runs
                    self._located[message.rank] = (message.host, message.pid)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))

    def _described(self, rank: int) -> str:
        where = self._located.get(rank)
        return f"(Ray actor, pid {where[1]} on {where[0]})" if where else "(Ray actor)"

    def check(self, rank: int) -> str | None:
        done, _ = ray.wait([self.runs[rank]], timeout=0)
        if done:
            try:
                ray.get(done[0], timeout=1.0)
                return f"{self._described(rank)} exited"
            except ray.exceptions.RayTaskError as exc:  # it raised: its Crashed record is on its way
                first = self._raised_at.setdefault(rank, time.monotonic())
                if time.monotonic() - first < RAISED_GRACE_S:
                    return None
                return (
                    f"{self._described(rank)} raised {exc.cause!r}"
                    if hasattr(exc, "cause")
                    else f"{self._described(rank)} raised"
                )
            except Exception as exc:  # noqa: BLE001 - ActorDiedError, node lost, ...
                return f"{self._described(rank)} died ({type(exc).__name__})"
        where = self._located.get(rank)
        if where is not None and where[0] == socket.gethostname():  # its process can be seen from here
            return stopped_or_gone(where[1], f"Ray actor, pid {where[1]} on {where[0]}")
        return None

    def pids(self) -> dict[int, int]:
        return {rank: self._located.get(rank, ("", 0))[1] for rank in self.runs}

    def close(self, kill: bool) -> None:
        if self.placement.closed or not ray.is_initialized():
            return  # the placement's teardown killed the rank actors
        if not kill and self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=STOP_GRACE_S)
        for rank in list(self.runs):
            host = self.placement.rank_hosts.pop(rank_name(rank), None)
            if host is not None:
                try:
                    ray.kill(host, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self.runs = {}
