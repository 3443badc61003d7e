"""Ray placement (`cluster.placement = 'ray'`): the pipeline's actors as Ray actors in one
placement group, on the nodes of a Ray cluster; imported only when a run asks for it.

    gapless train (driver, trainer rank 0) ── owns ──> placement group [gen 0 .. gen R-1, env 0 .. env E-1,
        │                                                 trainer rank 1 .. W-1]
        │                                                 each bundle {"CPU": threads}, strategy SPREAD
        ├── PostOffice actor (its node): channels, stop flag, heartbeats   (cluster/ray/mail.py)
        └── WeightBoard actor (its node): the newest weights' object refs  (cluster/ray/weights.py)
            or, with cluster.weight_transport = 'broadcast', a TCPStore on a free port of its node
            and a torch.distributed group of the trainer and the replicas (cluster/ray/broadcast.py)

Each actor is an `_ActorHost` that runs the same main function as a local process
(actors.generator_main / environment_main) on its `ActorSpec`, whose queues, flag, heartbeats and
weights are the Ray stand-ins this placement's factories make. `address` empty: the run starts a
private Ray instance on this machine (random ports, no dashboard, its own temporary directory) and
stops it at shutdown; else it joins that cluster and leaves it running.

Guaranteed: no wait is unbounded: the placement group is granted within
`cluster.placement_timeout_s` or the run fails with a PlacementError naming the demand and what
the cluster has (a demand the cluster cannot hold at all fails at once); an actor killed in any
way is reported by `exited` within a poll (its `run` call fails), one whose main function returned
a second later (so that its last message, an ActorError, arrives first); `shutdown` kills every
actor, removes the placement group and stops a private instance, also when the run fails before
its actors start (atexit). `exited` also reports the run's mailbox or weight board when it dies,
and each death carries Ray's reason (`ActorExit.why`, cluster/ray/deaths.py): a kill by Ray's memory
monitor names the node's memory figures and what to do. A private instance starts with Ray's memory
monitor threshold at 0.98 of the node's memory unless the environment sets it (cluster/ray/deaths.py).
Restarts are the pipeline's decision (every actor has
max_restarts = 0): a replacement replica or environment actor takes the bundle its evicted
predecessor held.
The trainer's data-parallel ranks 1..W-1 hold bundles of their own after the environment's
(`trainer_ranks`, cluster/ray/ranks.py); rank 0 is the driver. Not guaranteed: lending idle trainer
cores (local placement only).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from gapless.cluster.names import env_name, rank_name, replica_name
from gapless.cluster.placement import ActorExit, PlacementError, engine_environ
from gapless.cluster.ray.deaths import MONITOR_ENV, death_reason
from gapless.cluster.ray.mail import (
    PostOffice,
    RayChannel,
    RayHeartbeats,
    RayStopFlag,
    flush_writers,
    no_auto_init,
    quiesce,
    reopen,
)
from gapless.cluster.ray.weights import ObjectStoreSender, ObjectStoreWeights, WeightBoard
from gapless.config import Config, usable_cores

if TYPE_CHECKING:  # cluster/ray/broadcast.py imports torch.distributed: loaded when a run asks for it
    from gapless.cluster.ray.broadcast import BroadcastSender, BroadcastWeights

RETURNED_GRACE_S = 1.0  # an actor whose main returned is reported this long after (its last words first)
SERVICE_WAIT_S = 10 * 365 * 86400.0  # the mailbox's and the weight board's watch calls: never answered while they live
STRATEGY = "SPREAD"


@ray.remote(max_restarts=0, max_task_retries=0)
class _ActorHost:
    """One placed actor: runs its main function in the worker's main thread (signals work there)."""

    def run(self, main: Callable[[Any], None], spec: Any) -> None:
        try:
            main(spec)
        finally:
            flush_writers()

    def where(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()


class RayPlacement:
    kind = "ray"

    def __init__(self, cfg: Config, log=print):
        self.cfg, self.cluster, self.log = cfg, cfg.cluster, log
        self.ctx = mp.get_context("spawn")  # only for what stays in the trainer's process
        self.temp_dir: str | None = None
        self.private = not self.cluster.address
        self.hosts: dict[str, Any] = {}
        self.runs: dict[str, Any] = {}  # name -> ObjectRef of its run()
        self.returned: dict[str, float] = {}  # name -> when its run() was seen done
        self.bundles: dict[str, int] = {}  # name -> bundle index it holds
        self.pg = None
        self.sender: ObjectStoreSender | BroadcastSender | None = None
        self.broadcast = self.cluster.weight_transport == "broadcast"
        self.members: set[str] = set()  # actors in the broadcast group
        self.rank_hosts: dict[str, Any] = {}  # trainer ranks placed here (cluster/ray/ranks.py): killed at teardown
        self._closed = False
        no_auto_init()
        self._connect()
        atexit.register(self._teardown)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.office = PostOffice.options(scheduling_strategy=here).remote()
        self.board = WeightBoard.options(scheduling_strategy=here).remote()
        # calls that end only when the run stops or their actor dies: `exited` reports the death
        self.services = {
            "mailbox": self.office.wait_stop.remote(SERVICE_WAIT_S),
            "weight-board": self.board.newest.remote(2**62, SERVICE_WAIT_S),
        }

    # ---- connection ----------------------------------------------------------------------------
    def _demand(self) -> list[dict[str, float]]:
        """Bundles in index order: each replica, each environment actor, each trainer rank 1..W-1."""
        pl, c = self.cfg.pipeline, self.cluster
        ranks = [{"CPU": float(self.cfg.trainer.threads or pl.trainer_threads_resolved)}] * (c.trainer_world_size - 1)
        return [{"CPU": float(pl.generator_threads_resolved)}] * c.replicas + [{"CPU": 1.0}] * c.env_actors + ranks

    @property
    def closed(self) -> bool:
        """Torn down: no actor or rank can be placed any more."""
        return self._closed

    def rank_bundle(self, rank: int) -> int:
        """The bundle trainer rank `rank` (1..W-1) holds."""
        return self.cluster.replicas + self.cluster.env_actors + rank - 1

    def _connect(self) -> None:
        if ray.is_initialized():
            raise PlacementError(
                "cluster.placement = 'ray': this process is already connected to Ray; a run "
                "connects (and disconnects) itself"
            )
        options: dict[str, Any] = dict(
            include_dashboard=False, logging_level="warning", log_to_driver=True, namespace=f"gapless-{os.getpid()}"
        )
        if self.private:
            self.temp_dir = tempfile.mkdtemp(prefix="gapless-ray-")  # short: Ray's socket paths must fit 107 bytes
            cores = usable_cores()
            # placement tokens, not cores: the actors may share this machine's cores, as on the local
            # placement (reserve() warns as it does)
            options.update(
                num_cpus=max(cores, int(sum(b["CPU"] for b in self._demand()))),
                _temp_dir=self.temp_dir,
                _node_ip_address="127.0.0.1",
            )
            if self.cluster.object_store_mb:
                options["object_store_memory"] = self.cluster.object_store_mb << 20
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private instance: only this run talks to it
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        else:
            options["address"] = self.cluster.address
        # the actors see this run's GAPLESS_* settings (fault points, a fault log) also on nodes
        # started before it, whose workers inherit their raylet's environment, not the driver's
        if ours := {k: v for k, v in os.environ.items() if k.startswith("GAPLESS_")}:
            options["runtime_env"] = {"env_vars": ours}
        # the raylet reads its memory monitor's settings from the environment it starts with
        monitor = {k: v for k, v in MONITOR_ENV.items() if self.private and not _monitor_set()}
        os.environ.update(monitor)
        try:
            ray.init(**options)
            reopen()  # a new connection: mailbox calls may start again (after an earlier run's quiesce)
        except Exception as exc:
            self._teardown()
            where = (
                f"the Ray cluster at {self.cluster.address!r} (cluster.address)"
                if not self.private
                else "a private Ray instance"
            )
            raise PlacementError(f"could not start or join {where}: {exc}") from exc
        finally:
            for key in monitor:
                os.environ.pop(key, None)

    # ---- the Placement protocol ----------------------------------------------------------------
    def reserve(self, threads: dict[str, int]) -> str | None:
        """Ask the cluster for one bundle per replica, one per environment actor and one per trainer
        rank past rank 0; bounded wait."""
        demand = self._demand()
        total, free = ray.cluster_resources(), ray.available_resources()
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        ranks, envs = self.cluster.trainer_world_size - 1, self.cluster.env_actors
        described = (
            f"{len(demand)} bundles {demand} ({STRATEGY}: {self.cluster.replicas} replicas + "
            + ("the environment" if envs == 1 else f"{envs} environment actors")
            + (f" + {ranks} trainer rank{'s' if ranks > 1 else ''})" if ranks else ")")
        )
        available = (
            f"the cluster has {free.get('CPU', 0.0):g} of {total.get('CPU', 0.0):g} CPUs free on "
            f"{len(nodes)} nodes (CPUs per node: {sorted(nodes, reverse=True)})"
        )
        fix = (
            "add nodes (`ray start --address ...` on each), or lower cluster.replicas / "
            "pipeline.generator_threads"
            + (" / cluster.env_actors" if envs > 1 else "")
            + (" / cluster.trainer_world_size" if ranks else "")
        )
        biggest = max((b["CPU"] for b in demand), default=0.0)
        if sum(b["CPU"] for b in demand) > total.get("CPU", 0.0) or biggest > max(nodes, default=0.0):
            self._teardown()
            raise PlacementError(f"the actors need {described} but {available}: it can never fit; {fix}")
        self.pg = placement_group(demand, strategy=STRATEGY, name=f"gapless-{os.getpid()}")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.cluster.placement_timeout_s)
        if not ready:
            free = ray.available_resources()
            self._teardown()
            raise PlacementError(
                f"the actors need {described}, not granted within {self.cluster.placement_timeout_s:g} s "
                f"(cluster.placement_timeout_s); the cluster has {free.get('CPU', 0.0):g} CPUs free now; "
                f"{fix}"
            )
        self._record_nodes()
        used = sum(threads.values())
        if self.private and used > usable_cores():
            return f"the actors run {used} threads at once on {usable_cores()} cores: they will share cores"
        return None

    def _record_nodes(self) -> None:
        """placement.json in the run directory: which node holds each bundle (the actor on it)."""
        R, E, W = self.cluster.replicas, self.cluster.env_actors, self.cluster.trainer_world_size
        names = (
            [replica_name(r, R) for r in range(R)]
            + [env_name(e, E) for e in range(E)]
            + [rank_name(rank) for rank in range(1, W)]
        )
        try:
            to_node = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {})
            ips = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
            bundles = [
                {
                    "bundle": i,
                    "actor": name,
                    "resources": demand,
                    "node_id": to_node.get(i, ""),
                    "node_ip": ips.get(to_node.get(i, ""), ""),
                }
                for i, (name, demand) in enumerate(zip(names, self._demand()))
            ]
            Path(self.cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.cfg.run_dir) / "placement.json").write_text(
                json.dumps(
                    {
                        "strategy": STRATEGY,
                        "trainer_node_id": ray.get_runtime_context().get_node_id(),
                        "bundles": bundles,
                    },
                    indent=2,
                )
            )
        except (OSError, KeyError) as exc:  # a record for the reader, not a reason to stop the run
            self.log(f"warning: could not write placement.json: {exc!r}")

    def channel(self, maxsize: int = 0) -> RayChannel:
        return RayChannel(self.office, maxsize)

    def stop_flag(self) -> RayStopFlag:
        return RayStopFlag(self.office)

    def heartbeats(self, actors: tuple[str, ...]) -> RayHeartbeats:
        return RayHeartbeats(self.office, actors)

    def weights(self, state, version: int) -> ObjectStoreWeights | BroadcastWeights:
        if self.broadcast:
            from gapless.cluster.ray.broadcast import BroadcastSender, BroadcastWeights

            if self.sender is None:
                host = "127.0.0.1" if self.private else ray.util.get_node_ip_address()
                self.sender = BroadcastSender(
                    state, self.cluster.op_timeout_s, self.cluster.rendezvous_timeout_s, host, self.log
                )
            if version > self.sender.version:
                self.sender.publish(state, version)
            return BroadcastWeights(self.sender)  # start() names its member after the actor
        if self.sender is None:
            self.sender = ObjectStoreSender(self.board, state)
        if version > self.sender.version:
            self.sender.publish(state, version)
        return ObjectStoreWeights(self.sender, self.cluster.op_timeout_s, self.cluster.rendezvous_timeout_s)

    def start(self, name: str, main: Callable[[Any], None], spec: Any) -> None:
        if self.pg is None:
            raise RuntimeError("RayPlacement.start before reserve(): the placement group is not granted")
        held = set(self.bundles.values())
        R = self.cluster.replicas
        candidates = range(R, R + self.cluster.env_actors) if name.startswith("environment") else range(R)
        bundle = next((i for i in candidates if i not in held), None)
        if bundle is None:
            raise PlacementError(f"no free bundle for {name}: bundles held {self.bundles}")
        if self.broadcast and getattr(spec, "weights", None) is not None:
            spec.weights.member = name
            self.sender.expect(name)
            self.members.add(name)
        # a worker starts with its runtime_env's variables (merged with the run's GAPLESS_* ones):
        # a replica's OpenMP reads its wait policy when torch loads, before `main` runs
        extra = engine_environ(name, getattr(spec, "cfg", None))
        self.hosts[name], self.runs[name] = self.place(bundle, main, spec, extra)
        self.bundles[name] = bundle

    def place(
        self, bundle: int, main: Callable[[Any], None], spec: Any, env_vars: dict[str, str] | None = None
    ) -> tuple[Any, Any]:
        """Start an `_ActorHost` on `bundle` of the placement group running `main(spec)`, its
        process started with `env_vars` added; returns the host and the ObjectRef of its run."""
        if self.pg is None:
            raise RuntimeError("RayPlacement.place before reserve(): the placement group is not granted")
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        cpus = self._demand()[bundle]["CPU"]
        options: dict[str, Any] = dict(num_cpus=cpus, scheduling_strategy=strategy, name=None)
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        host = _ActorHost.options(**options).remote()
        # the actor is not the trainer's child: Ray ties its life to this driver instead of PR_SET_PDEATHSIG
        return host, host.run.remote(main, dataclasses.replace(spec, trainer_pid=0))

    def trainer_ranks(self):
        """Where the trainer's ranks 1..W-1 run: Ray actors on their bundles (cluster/ray/ranks.py)."""
        from gapless.cluster.ray.ranks import RayRanks

        return RayRanks(self)

    def exited(self) -> list[ActorExit]:
        """Placed actors that are gone, and the run's mailbox or weight board if one died (each
        with Ray's reason: a kill by Ray's memory monitor names the node's memory figures)."""
        refs = {**self.runs, **(self.services if not self._closed else {})}
        if not refs:
            return []
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        done = set(done)
        gone, now = [], time.monotonic()
        for name, ref in refs.items():
            if ref not in done:
                continue
            try:
                ray.get(ref, timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - killed (ActorDiedError, OutOfMemoryError) or its node lost
                gone.append(ActorExit(name, None, death_reason(exc)))
                continue
            if name in self.services:
                continue  # the stop flag was set: the run is ending
            since = self.returned.setdefault(name, now)
            if now - since >= RETURNED_GRACE_S:
                gone.append(ActorExit(name, 0))
        return gone

    def kill(self, name: str) -> None:
        host = self.hosts.pop(name, None)
        self.runs.pop(name, None)
        self.returned.pop(name, None)
        self.bundles.pop(name, None)
        if host is not None:
            ray.kill(host, no_restart=True)
        if name in self.members and self.sender is not None:
            self.members.discard(name)
            self.sender.drop(name)  # the group is rebuilt without it before the next send

    def shutdown(self, stop, grace_s: float) -> None:
        if self.runs:
            stop.set()
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=grace_s)
        self._teardown()

    def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.sender is not None:
            self.sender.close()
            if hasattr(self.sender, "report"):
                try:
                    (Path(self.cfg.run_dir) / "relay.json").write_text(json.dumps(self.sender.report(), indent=2))
                except OSError:
                    pass
        if ray.is_initialized():
            for host in [*self.hosts.values(), *self.rank_hosts.values()]:
                try:
                    ray.kill(host, no_restart=True)
                except Exception:
                    pass
            if self.pg is not None:
                try:
                    remove_placement_group(self.pg)
                except Exception:
                    pass
            quiesce()  # no thread of ours may be inside ray.get while the connection goes
            ray.shutdown()
        self.hosts, self.runs, self.rank_hosts = {}, {}, {}
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _monitor_set() -> bool:
    """The environment already chooses Ray's memory monitor settings (cluster/ray/deaths.py)."""
    return any(key in os.environ for key in ("RAY_memory_usage_threshold", "RAY_memory_monitor_refresh_ms"))
