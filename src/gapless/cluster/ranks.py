"""Where the data-parallel trainer's ranks 1..W-1 run, how they meet, and how rank 0 hears them.

`DataParallelTrainer` (distributed.py) starts, talks to and watches its ranks only through a
`RankHosts`; the rank code (dp_rank.rank_main) is the same wherever it runs:

    LocalRanks   spawned processes on this machine, multiprocessing queues, a file store in a
                 private temporary directory (the default; never imports Ray).
    RayRanks     Ray actors in the run's placement group, the mailbox's channels, a TCP store on a
                 free port of the trainer's node (cluster/ray/ranks.py; cluster.placement = 'ray').

Guaranteed by both: `check` names a rank that died (with what is known: pid, exit code) within a
poll of rank 0's; a rank stopped with SIGSTOP is named at once where its process can be seen from
the trainer's machine (every local rank; a Ray rank on the trainer's node), else when its
collective times out (cluster.op_timeout_s); `close` leaves no rank running. Not guaranteed: the
order of replies from different ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Protocol, runtime_checkable

import torch.distributed as dist

from gapless.cluster.watchdog import process_state


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet to build their group: a file store on this machine (`path`), or the
    TCP store rank 0 serves (`host`, `port`); picklable."""

    path: str = ""
    host: str = ""
    port: int = 0

    def client(self, world_size: int, timeout_s: float):
        """The store as seen by ranks 1..W-1."""
        if self.path:
            return dist.FileStore(self.path, world_size)
        return dist.TCPStore(self.host, self.port, world_size, False, timedelta(seconds=timeout_s), use_libuv=False)

    @staticmethod
    def serve(host: str, timeout_s: float) -> tuple["Rendezvous", Any]:
        """A TCPStore this process serves on a free port of `host`, and its address: the socket is
        bound here and handed to the store (nothing is closed and rebound, no fixed port)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the descriptor (Python must not close it under the store)
        store = dist.TCPStore(
            host,
            port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=False,
        )
        return Rendezvous(host=host, port=port), store


def stopped_or_gone(pid: int, label: str = "") -> str | None:
    """Why the process `pid` of this machine cannot take part in a collective ('(LABEL) died',
    '(LABEL) is T (stopped)'), or None; LABEL defaults to 'pid PID'."""
    state = process_state(pid)
    label = label or f"pid {pid}"
    if state.startswith(("Z", "gone")):
        return f"({label}) died"
    if state.startswith(("T", "t")):
        return f"({label}) is {state}"
    return None


@runtime_checkable
class RankHosts(Protocol):
    kind: str
    rendezvous: Rendezvous

    def store(self, world_size: int, timeout_s: float) -> Any:
        """Rank 0's side of the rendezvous store."""

    def channel(self) -> Any:
        """A queue to one rank (put); its spec carries it."""

    def outbox(self, rank: int) -> Any:
        """The queue rank `rank` answers on (put in the rank)."""

    def start(self, rank: int, main: Callable[[Any], None], spec: Any) -> None:
        """Run `main(spec)` as rank `rank`, dying with the trainer."""

    def receive(self, wait_s: float) -> list:
        """The ranks' replies that arrived, waiting up to `wait_s` when there are none."""

    def check(self, rank: int) -> str | None:
        """None while rank `rank` runs, else why not ('(pid 12) died with exit code -9', ...)."""

    def pids(self) -> dict[int, int]:
        """Each started rank's pid on its own machine (0 where not yet known)."""

    def close(self, kill: bool) -> None:
        """Wait for the ranks to exit (a few seconds; at once when `kill`), kill what is left,
        free the rendezvous."""


class LocalRanks:
    kind = "local"

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="gapless-dp-")
        self.rendezvous = Rendezvous(path=os.path.join(self._dir, "store"))
        self._outbox = self.ctx.Queue()  # every rank writes here (a multiprocessing queue takes many writers)
        self.processes: dict[int, Any] = {}

    def store(self, world_size: int, timeout_s: float):
        return dist.FileStore(self.rendezvous.path, world_size)

    def channel(self):
        return self.ctx.Queue()

    def outbox(self, rank: int):
        return self._outbox

    def start(self, rank: int, main: Callable[[Any], None], spec: Any) -> None:
        process = self.ctx.Process(target=main, args=(spec,), name=f"gapless-trainer-rank{rank}", daemon=True)
        process.start()
        self.processes[rank] = process

    def receive(self, wait_s: float) -> list:
        out = []
        try:
            out.append(self._outbox.get(timeout=wait_s) if wait_s > 0 else self._outbox.get_nowait())
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            return out

    def check(self, rank: int) -> str | None:
        process = self.processes[rank]
        if not process.is_alive():
            return f"(pid {process.pid}) died with exit code {process.exitcode}"
        return stopped_or_gone(process.pid)

    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def close(self, kill: bool) -> None:
        for process in self.processes.values():
            process.join(timeout=5.0 if not kill else 0)
            if process.is_alive():
                process.kill()
            process.join(timeout=5.0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def store_dir(self) -> str:
        return self._dir
