"""The pipeline on Ray placement (slow): a local multi-node Ray cluster started by the test
(`ray.cluster_utils.Cluster`: a head without CPUs for the trainer and four 1-CPU nodes, all on
127.0.0.1), and a private instance that `gapless train` starts itself.

Checked: at budget 0 the Ray placement reproduces the local placement bitwise (same checkpoint,
same ledger) with its actors spread over the virtual nodes; the headline scenario (2 replicas, the
environment and trainer rank 1 on four nodes, budget 1, a replica SIGKILLed at step 3) completes
exactly once within the budget; an infeasible placement fails within
15 s with an error naming the demand and what is available; `gapless train --cluster.placement ray
--cluster.replicas 2` runs with no Ray running and survives a replica killed with SIGKILL (its
groups end `replica_lost`, exactly once); with `--cluster.weight_transport broadcast` both
replicas' versions increase and end on the trainer's final state, and a killed replica makes the
relay rebuild its group (the survivor, and the replacement if it joined before the end, end on
the last version); no run
leaves a Ray process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from crash import SRC, train  # noqa: E402
from test_ray_placement import ray_processes  # noqa: E402

from gapless.orchestrate.ledger import check_ledger, read_events  # noqa: E402

CONFIG = str(Path(__file__).parents[2] / "configs" / "smoke.toml")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.json")
NODES = 4  # 1-CPU worker nodes: 2 replicas + the environment + trainer rank 1, one per node


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every node on loopback (this box advertises eth0 otherwise)
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    temp_dir = tempfile.mkdtemp(prefix="gapless-rc-")
    # Cluster records the head's address in Ray's default temp dir (/tmp/ray), which it does not create
    from ray._private.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    common = dict(node_ip_address="127.0.0.1", object_store_memory=200 << 20)
    c = Cluster(
        initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, temp_dir=temp_dir, **common)
    )
    try:
        for _ in range(NODES):
            c.add_node(num_cpus=1, **common)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        deadline = time.monotonic() + 15
        while ray_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = ray_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, left


def _args(run: Path, warm_cache: Path, steps: int, budget: int, *extra: str) -> list[str]:
    return [
        CONFIG,
        "--run-dir",
        str(run),
        "--warmstart.cache_dir",
        str(warm_cache),
        "--loop.steps",
        str(steps),
        "--loop.eval_every",
        "100",
        "--loop.checkpoint_every",
        str(steps),
        "--pipeline.max_staleness",
        str(budget),
        "--trainer.threads",
        "1",
        "--pipeline.generator_threads",
        "1",
        "--pipeline.trainer_threads",
        "1",
        "--metrics.tensorboard",
        "false",
        *extra,
    ]


def _ledger(run: Path) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("t", "time")} for e in read_events(run / "groups.jsonl")]


def _actor_hosts_gone(timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [line for line in ray_processes("ray::_ActorHost")]:
            return True
        time.sleep(0.2)
    return False


def test_ray_placement_on_a_multi_node_cluster_reproduces_local_bitwise(tmp_path, warm_cache, cluster):
    steps = 4
    local = train(_args(tmp_path / "local", warm_cache, steps, 0), tmp_path / "local.txt", timeout_s=900)
    assert local.rc == 0 and local.survivors == [], local.stderr[-2000:]
    placed = train(
        _args(
            tmp_path / "ray", warm_cache, steps, 0, "--cluster.placement", "ray", "--cluster.address", cluster.address
        ),
        tmp_path / "ray.txt",
        timeout_s=900,
    )
    assert placed.rc == 0 and placed.survivors == [], placed.stderr[-2000:]
    for name in CHECKPOINT_FILES:
        a = (tmp_path / "local" / "checkpoints" / f"step_{steps}" / name).read_bytes()
        b = (tmp_path / "ray" / "checkpoints" / f"step_{steps}" / name).read_bytes()
        assert a == b, name
    assert _ledger(tmp_path / "local") == _ledger(tmp_path / "ray")
    assert _actor_hosts_gone()  # the run's actors died with it; the cluster stays up


RESERVE = """
import json, sys, time
from gapless.config import load_config
from gapless.cluster import make_placement
from gapless.cluster.placement import PlacementError
cfg = load_config(sys.argv[1], json.loads(sys.argv[2]))
start = time.monotonic()
try:
    make_placement(cfg).reserve({})
    error = None
except PlacementError as exc:
    error = str(exc)
print(json.dumps({"elapsed_s": time.monotonic() - start, "error": error}))
"""


def test_an_infeasible_placement_fails_fast_naming_demand_and_supply(tmp_path, cluster):
    overrides = {
        "run_dir": json.dumps(str(tmp_path / "run")),
        "cluster.placement": '"ray"',
        "cluster.address": json.dumps(cluster.address),
        "cluster.replicas": "4",
        "cluster.placement_timeout_s": "10",
        "pipeline.generator_threads": "1",
    }
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", RESERVE, CONFIG, json.dumps(overrides)], capture_output=True, text=True, timeout=120
    )
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["error"] is not None, done.stderr[-2000:]  # 4 replicas + the environment on 4 CPUs
    assert outcome["elapsed_s"] < 15 and time.monotonic() - start < 60
    assert "5 bundles" in outcome["error"] and f"{NODES} of {NODES} CPUs free" in outcome["error"], outcome["error"]
    assert "cluster.replicas" in outcome["error"]  # the fix


def _faulted_run(tmp_path: Path, warm_cache: Path, cluster, fault: str, *extra: str) -> tuple[dict, list[dict], dict]:
    """A 6-step run at budget 1 on the cluster with `fault`: it completes with nothing left behind,
    every admitted group ends exactly once and every trained staleness is within the budget.
    Returns the actors' nodes (placement.json), the ledger and staleness.json."""
    steps, budget = 6, 1
    run = tmp_path / "run"
    outcome = train(
        _args(
            run,
            warm_cache,
            steps,
            budget,
            "--cluster.placement",
            "ray",
            "--cluster.address",
            cluster.address,
            "--cluster.op_timeout_s",
            "30",
            *extra,
        ),
        tmp_path / "err.txt",
        fault,
        timeout_s=900,
    )
    assert outcome.fault_time is not None, outcome.stderr[-2000:]
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == [], outcome.survivors
    placed = json.loads((run / "placement.json").read_text())
    nodes = {b["actor"]: b["node_id"] for b in placed["bundles"]}
    assert placed["trainer_node_id"] not in nodes.values() and len(set(nodes.values())) == len(nodes), placed
    events = read_events(run / "groups.jsonl")
    check_ledger(events, steps, 2)  # every admitted group ends exactly once; each step trained once
    trained = [e for e in events if e["event"] == "trained"]
    assert trained and all(0 <= e["staleness"] <= budget for e in trained)
    assert _actor_hosts_gone()
    return nodes, events, json.loads((run / "staleness.json").read_text())


def test_headline_replicas_environment_and_trainer_ranks_across_nodes_survive_a_killed_replica(
    tmp_path, warm_cache, cluster
):
    """2 generator replicas, the environment and trainer rank 1 each on its own virtual node (rank 0
    is the driver, on the head), budget 1; replica 1 is SIGKILLed while it loads its third weight
    version (step 3). The run completes, every admitted group ends exactly once, every trained
    staleness is within the budget, and nothing of the run is left on the cluster."""
    nodes, events, summary = _faulted_run(
        tmp_path,
        warm_cache,
        cluster,
        "generator-1:fetch:3:kill",
        "--cluster.replicas",
        "2",
        "--cluster.trainer_world_size",
        "2",
    )
    assert sorted(nodes) == ["environment", "generator-0", "generator-1", "trainer-rank1"] and len(nodes) == NODES
    assert [e["replica"] for e in summary["evictions"]] == ["generator-1"], summary["evictions"]
    assert sum(1 for e in events if e.get("reason") == "replica_lost") == summary["drops"].get("replica_lost", 0)


def test_environment_actors_on_other_nodes_survive_a_killed_one(tmp_path, warm_cache, cluster):
    """Two environment actors, each on its own virtual node, budget 1; environment actor 1 is
    SIGKILLed at its second scored group: it is evicted, the groups routed to it end as
    `env_lost`, a fresh actor takes its bundle, and the run completes exactly once."""
    nodes, events, summary = _faulted_run(
        tmp_path,
        warm_cache,
        cluster,
        "environment-1:score:2:kill",
        "--cluster.env_actors",
        "2",
        "--pipeline.env_workers",
        "2",
    )
    assert sorted(nodes) == ["environment-0", "environment-1", "generator"]
    assert [e["environment"] for e in summary["env_evictions"]] == ["environment-1"], summary
    lost = sum(1 for e in events if e.get("reason") == "env_lost")
    assert lost >= 1 and lost == summary["drops"]["env_lost"]


def test_gapless_train_on_a_private_ray_instance_survives_a_killed_replica(tmp_path, warm_cache):
    steps, budget = 6, 1
    run = tmp_path / "run"
    outcome = train(
        _args(
            run,
            warm_cache,
            steps,
            budget,
            "--cluster.placement",
            "ray",
            "--cluster.replicas",
            "2",
            "--cluster.op_timeout_s",
            "5",
        ),
        tmp_path / "err.txt",
        "generator-1:decode:3:kill",
        timeout_s=900,
    )
    assert outcome.fault_time is not None, outcome.stderr[-2000:]
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == [], outcome.survivors  # the private instance is gone with the run
    events = read_events(run / "groups.jsonl")
    check_ledger(events, steps, 2)  # every admitted group ends exactly once; each step trained once
    trained = [e for e in events if e["event"] == "trained"]
    assert trained and all(0 <= e["staleness"] <= budget for e in trained)
    summary = json.loads((run / "staleness.json").read_text())
    assert [e["replica"] for e in summary["evictions"]] == ["generator-1"], summary["evictions"]
    lost = sum(1 for e in events if e.get("reason") == "replica_lost")
    assert lost == summary["drops"].get("replica_lost", 0)


def test_gapless_train_with_the_broadcast_weight_transport(tmp_path, warm_cache):
    """Two replicas take their weights over the gloo broadcast group: the versions each flipped to
    increase, each landed buffer's checksum equals the one the trainer sent, and the last version
    both hold is the trainer's final state (the checkpoint's weights, packed the same way)."""
    import torch

    from gapless.cluster.ray.broadcast import checksum
    from gapless.cluster.ray.weights import Layout
    from gapless.models import load_local

    steps, budget = 3, 1
    run = tmp_path / "run"
    outcome = train(
        _args(
            run,
            warm_cache,
            steps,
            budget,
            "--cluster.placement",
            "ray",
            "--cluster.replicas",
            "2",
            "--cluster.weight_transport",
            "broadcast",
            "--cluster.op_timeout_s",
            "20",
        ),
        tmp_path / "err.txt",
        timeout_s=900,
    )
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == [], outcome.survivors  # no Ray or torch process outlives the run
    check_ledger(read_events(run / "groups.jsonl"), steps, 2)
    relay = json.loads((run / "relay.json").read_text())
    assert relay["error"] is None and relay["backend"] == "gloo" and relay["dropped"] == [], relay
    assert sorted(relay["flips"]) == ["generator-0", "generator-1"], relay["flips"]
    for member, flips in relay["flips"].items():
        assert flips == sorted(set(flips)), (member, flips)  # monotonic
        assert flips[-1] == relay["published"] == steps, (member, flips, relay["published"])
    state = load_local(run / "checkpoints" / f"step_{steps}").model.state_dict()
    layout = Layout(state)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for name, view in layout.views(flat).items():
        view.copy_(state[name])
    assert relay["checksums"][str(steps)] == checksum(flat)  # the replicas' last weights = the trainer's state


def test_the_broadcast_group_is_rebuilt_when_a_replica_is_killed(tmp_path, warm_cache):
    """A replica killed with SIGKILL mid-run: the relay rebuilds its group without it (and with the
    replacement once that joins), the run completes exactly once, and every member's versions still
    increase."""
    steps, budget = 6, 1
    run = tmp_path / "run"
    outcome = train(
        _args(
            run,
            warm_cache,
            steps,
            budget,
            "--cluster.placement",
            "ray",
            "--cluster.replicas",
            "2",
            "--cluster.weight_transport",
            "broadcast",
            "--cluster.op_timeout_s",
            "5",
        ),
        tmp_path / "err.txt",
        "generator-1:decode:3:kill",
        timeout_s=900,
    )
    assert outcome.fault_time is not None, outcome.stderr[-2000:]
    assert outcome.rc == 0, outcome.stderr[-3000:]
    assert outcome.survivors == [], outcome.survivors
    check_ledger(read_events(run / "groups.jsonl"), steps, 2)
    summary = json.loads((run / "staleness.json").read_text())
    assert [e["replica"] for e in summary["evictions"]] == ["generator-1"], summary["evictions"]
    relay = json.loads((run / "relay.json").read_text())
    assert relay["error"] is None, relay
    # a group with replica 1 (both replicas may say hello before the first group is built, or
    # one after the other), then one rebuilt without it; the last group does not have it
    first_with = next(i for i, members in enumerate(relay["groups"]) if "generator-1" in members)
    assert len(relay["groups"]) == relay["epochs"] >= first_with + 2, relay
    assert "generator-1" not in relay["groups"][-1] and "generator-0" in relay["groups"][-1], relay
    for member, flips in relay["flips"].items():
        assert flips == sorted(set(flips)), (member, flips)
    assert relay["published"] == steps and relay["flips"]["generator-1"][-1] < steps, relay
    # the survivor ends on the last version; the replacement starts while the run goes on (it is not
    # waited for), and if it joined before the end it was sent the newest version too
    others = {m: f for m, f in relay["flips"].items() if m != "generator-1"}
    assert relay["flips"]["generator-0"][-1] == steps and all(f[-1] == steps for f in others.values()), relay


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_a_killed_trainer_rank_on_another_node_ends_the_run_and_resume_finishes(tmp_path, warm_cache, cluster):
    """Trainer rank 1 (a Ray actor on a worker node) SIGKILLed after the second checkpoint: the step
    it was in ends within 2 s of the kill, the run exits with code 3 and an error naming rank 1,
    nothing of the run is left, and `--resume` finishes the job from the last checkpoint."""
    from gapless.timeline import read_records
    from gapless.trainer.checkpoint import latest_checkpoint

    run = tmp_path / "run"
    ray_args = [
        "--cluster.placement",
        "ray",
        "--cluster.address",
        cluster.address,
        "--cluster.trainer_world_size",
        "2",
        "--cluster.op_timeout_s",
        "30",
    ]
    command = [
        sys.executable,
        "-m",
        "gapless.cli",
        "train",
        *_args(run, warm_cache, 40, 1, *ray_args),
        "--loop.checkpoint_every",
        "1",
    ]
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while latest_checkpoint(run) is None or latest_checkpoint(run).name in ("step_1",):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never checkpointed"
            time.sleep(0.2)
        ranks = [
            int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(int(p.name)) == "gapless-rank1"
        ]
        assert len(ranks) == 1, ranks
        killed_at = time.time()
        os.kill(ranks[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, stderr[-3000:]
    assert "trainer rank 1" in stderr and "--resume" in stderr, stderr[-3000:]
    steps = [r for r in read_records(run) if r["actor"] == "trainer" and r["name"] == "train"]
    assert steps and steps[-1]["end"] - killed_at < 2.0, (steps[-1], killed_at)
    assert _actor_hosts_gone()

    step = json.loads((latest_checkpoint(run) / "trainer_state.json").read_text())["step"]
    done = subprocess.run(
        [*command[:-2], "--loop.steps", str(step + 1), "--resume"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((latest_checkpoint(run) / "trainer_state.json").read_text())["step"] == step + 1
    assert _actor_hosts_gone()
