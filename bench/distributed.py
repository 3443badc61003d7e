"""Ray placement figures, in one run: weight relay time against bytes and receivers, the
trainer-blocking part of a push, failure detection, and s/step of Ray placement against local.

1. Relay (`cluster.weight_transport` 'object_store' and 'broadcast', gloo): on a private Ray
   instance, receivers placed as Ray actors (RayPlacement) hold an ObjectStoreWeights receiver
   and a BroadcastWeights group member each. The trainer
   publishes a state of S bytes; the relay time is publish -> the last receiver flipped to it
   (wall clock, one host). S in --sizes (MB), receivers 1 and 2, median of --reps; the reps of all
   sizes are interleaved (round v sends version v at every size). Fitted per transport and receiver
   count as T = alpha + S / B (least squares of the relative error), then checked on the held-out
   size (--held-out MB): the prediction must fall within 25% of the measurement.
2. Trainer-blocking push: the default model's state (model.* defaults), SharedWeights.publish
   (local placement's shared-memory double buffer, no reader) against ObjectStoreSender.publish
   and BroadcastSender.publish (the copy into the staging half; the relay thread does the rest),
   interleaved, medians.
3. Failure detection: a placed actor killed with SIGKILL -> RayPlacement.exited() reports it;
   one stopped with SIGSTOP -> its heartbeat age on the trainer passes a 2 s threshold (the
   pipeline evicts at cluster.op_timeout_s the same way); the excess over 2 s is the error.
4. s/step: `gapless train` at one replica, budget 1, --steps steps, local and Ray placement (a
   private instance the run starts itself) interleaved for --step-rounds rounds, for each of
   --step-jobs (configs/smoke.toml: ~45 ms steps, where Ray's fixed per-message latency shows;
   the embedded default job); the mean perf/step_s of the steps after the first (Ray's start-up
   is not a step), i.e. their wall time over their count: at budget 1 the steps alternate between
   one that waits for generation and one whose groups were all buffered already (0.2 s against
   1.2 s on the default job), so a median reads whichever kind is one more; local also without
   lending the trainer the replica's idle threads (Ray placement does not lend).

    PYTHONPATH=src python bench/distributed.py [--sizes 4,8,16,64] [--held-out 32] [--reps 5] [--steps 13]
                                               [--parts push,relay,steps] [--transports object_store,broadcast]

Prints one line per measurement, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
ROOT = HERE.parent
MB = 1 << 20


@dataclass
class ReceiverSpec:
    name: str
    trainer_pid: int
    inbox: Any
    outbox: Any
    stop: Any
    heartbeats: Any
    weights: dict  # key -> ObjectStoreWeights receiver or BroadcastWeights member


def receiver_main(spec: ReceiverSpec) -> None:
    """Fetch the handles the trainer activates; report each version landed with its wall time."""
    import queue

    spec.heartbeats.register(spec.name)
    spec.outbox.put(("pid", os.getpid()))
    active: dict[str, int] = {}
    while not spec.stop.is_set():
        spec.heartbeats.beat(spec.name)
        try:
            key = spec.inbox.get(timeout=0.001)
            active[key] = -1
        except queue.Empty:
            pass
        for key, have in list(active.items()):
            try:
                got = spec.weights[key].fetch_into(lambda state, v: None, have)
            except RuntimeError:  # its sender was closed (a broadcast member loses its store): done with it
                active.pop(key)
                continue
            if got is not None:
                active[key] = got
                spec.outbox.put(("landed", key, got, time.time()))


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """T = alpha + S / B over (S bytes, T s), least squares of the *relative* error (weights 1/T^2:
    the target is a relative one, and plain least squares lets the largest size decide the line):
    returns (alpha s, B bytes/s)."""
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sx = sum(wi * s for wi, (s, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * s * s for wi, (s, _) in zip(w, points))
    sxy = sum(wi * s * t for wi, (s, t) in zip(w, points))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - slope * sx) / sw
    return alpha, 1.0 / slope


def relay_and_failures(
    sizes_mb: list[int], held_out_mb: int, reps: int, transports: tuple[str, ...] = ("object_store", "broadcast")
) -> dict:
    from gapless.cluster import make_placement
    from gapless.cluster.ray.broadcast import BroadcastSender, BroadcastWeights
    from gapless.cluster.ray.weights import ObjectStoreSender, ObjectStoreWeights, WeightBoard
    from gapless.config import load_config

    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    cfg = load_config(
        ROOT / "configs" / "smoke.toml",
        {
            "cluster.placement": '"ray"',
            "cluster.replicas": "2",
            "pipeline.generator_threads": "1",
            "cluster.object_store_mb": "3000",
            "run_dir": json.dumps(tempfile.mkdtemp(prefix="gapless-bench-")),
        },
    )
    placement = make_placement(cfg)
    out: dict = {}
    try:
        placement.reserve({})
        stop, beats = placement.stop_flag(), placement.heartbeats(("trainer", "r0", "r1"))
        senders, handles = {}, [{}, {}]  # handles: one dict per receiver
        for transport in transports:
            for mb in sorted(set(sizes_mb + [held_out_mb])):
                for receivers in (1, 2):
                    key = f"{transport}-{mb}MB-R{receivers}"
                    state = {"w": torch.zeros(mb * MB // 4)}
                    if transport == "object_store":
                        senders[key] = ObjectStoreSender(WeightBoard.remote(), state)
                        handles[0][key] = handles[1][key] = ObjectStoreWeights(senders[key], 60.0, 600.0)
                    else:
                        senders[key] = BroadcastSender(state, 60.0, 600.0, "127.0.0.1", log=print)
                        for r in range(receivers):
                            handles[r][key] = BroadcastWeights(senders[key], f"r{r}")
                            senders[key].expect(f"r{r}")
                    senders[key].publish(state, 0)
        boxes = []
        for r in range(2):
            inbox, outbox = placement.channel(), placement.channel()
            placement.start(
                f"generator-{r}" if r == 0 else "generator-1",
                receiver_main,
                ReceiverSpec(f"r{r}", os.getpid(), inbox, outbox, stop, beats, handles[r]),
            )
            boxes.append((inbox, outbox))
        pids = [box[1].get(timeout=300)[1] for box in boxes]

        def landed(outbox, key, version, timeout_s=120.0) -> float:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                kind, k, v, t = outbox.get(timeout=deadline - time.monotonic())
                if k == key and v == version:
                    return t
            raise TimeoutError(key)

        # every size's reps are interleaved (round v publishes version v of every key, in an order
        # that rotates), so a busy spell of the shared box lands on all sizes alike, not on one
        keys = list(senders)
        receivers_of = {key: int(key.rsplit("R", 1)[1]) for key in keys}
        for key in keys:
            for inbox, outbox in boxes[: receivers_of[key]]:
                inbox.put(key)
                landed(outbox, key, 0, 300)
        times: dict[str, list[float]] = {key: [] for key in keys}
        for v in range(1, reps + 1):
            for key in keys[v % len(keys) :] + keys[: v % len(keys)]:
                sender = senders[key]
                state = {"w": torch.full((sender.layout.nbytes // 4,), float(v))}
                t0 = time.time()
                sender.publish(state, v)
                times[key].append(max(landed(outbox, key, v) for _, outbox in boxes[: receivers_of[key]]) - t0)
        relay: dict[str, dict] = {}
        for key, sender in senders.items():
            relay[key] = {
                "transport": key.split("-")[0],
                "bytes": sender.layout.nbytes,
                "receivers": receivers_of[key],
                "median_s": statistics.median(times[key]),
                "runs_s": [round(t, 4) for t in times[key]],
            }
            print(f"relay {key}: median {relay[key]['median_s'] * 1e3:.1f} ms  {relay[key]['runs_s']}", flush=True)
            sender.close()
        fits = {}
        for transport, receivers in [(t, r) for t in transports for r in (1, 2)]:
            points = [
                (d["bytes"], d["median_s"])
                for k, d in relay.items()
                if d["transport"] == transport and d["receivers"] == receivers and d["bytes"] != held_out_mb * MB
            ]
            alpha, bandwidth = _fit(points)
            held = relay[f"{transport}-{held_out_mb}MB-R{receivers}"]
            predicted = alpha + held["bytes"] / bandwidth
            error = abs(predicted - held["median_s"]) / held["median_s"]
            fits[f"{transport}-R{receivers}"] = {
                "alpha_s": alpha,
                "bandwidth_GBps": bandwidth / 1e9,
                "held_out_MB": held_out_mb,
                "held_out_measured_s": held["median_s"],
                "held_out_predicted_s": predicted,
                "held_out_error": error,
                "within_25pct": error <= 0.25,
            }
            print(
                f"fit {transport} R={receivers}: alpha {alpha * 1e3:.1f} ms, B {bandwidth / 1e9:.2f} GB/s; held-out "
                f"{held_out_mb} MB measured {held['median_s'] * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms "
                f"({error:.0%})",
                flush=True,
            )
        out.update(relay=relay, relay_fit=fits)

        # failure detection: SIGSTOP r1 (heartbeat age past 2 s), SIGKILL r0 (exited)
        threshold = 2.0
        beats.age_s("r1")
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while beats.age_s("r1") <= threshold:
            time.sleep(0.01)
        stop_detect = time.monotonic() - stopped
        os.kill(pids[1], signal.SIGCONT)
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        while not any(e.name == "generator-0" for e in placement.exited()):
            time.sleep(0.005)
        kill_detect = time.monotonic() - killed
        out["failure_detection"] = {
            "ray_actor_sigkill_s": kill_detect,
            "heartbeat_threshold_s": threshold,
            "sigstop_detected_after_s": stop_detect,
            "sigstop_excess_over_threshold_s": stop_detect - threshold,
        }
        print(
            f"detection: SIGKILL -> exited {kill_detect * 1e3:.0f} ms; SIGSTOP -> heartbeat age past {threshold:g} s "
            f"after {stop_detect:.2f} s",
            flush=True,
        )
    finally:
        placement.shutdown(placement.stop_flag(), 2.0)
    return out


def blocking_push(reps: int) -> dict:
    import ray

    from gapless.cluster.ray.broadcast import BroadcastSender
    from gapless.cluster.ray.weights import ObjectStoreSender, WeightBoard
    from gapless.cluster.weights import SharedWeights
    from gapless.config import ModelConfig
    from gapless.envs.code.problems import generate_problems
    from gapless.models import build_tiny

    problems = generate_problems(0, "train", 64, [1, 2, 3])
    torch.manual_seed(0)
    policy = build_tiny(ModelConfig(), [p.prompt + p.solution for p in problems], seed=0)
    state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    temp = tempfile.mkdtemp(prefix="gapless-ray-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=temp, _node_ip_address="127.0.0.1", logging_level="warning")
    try:
        shm = SharedWeights(state, 0)
        sender = ObjectStoreSender(WeightBoard.remote(), state)
        sender.publish(state, 0)
        caster = BroadcastSender(state, 60.0, 600.0, "127.0.0.1")
        caster.publish(state, 0)
        local, cluster, broadcast = [], [], []
        for v in range(1, reps + 1):
            t = time.perf_counter()
            shm.publish(state, v)
            local.append(time.perf_counter() - t)
            sender.wait_relayed(v - 1, 30)  # as in a run: the previous version has left (a step apart)
            t = time.perf_counter()
            sender.publish(state, v)
            cluster.append(time.perf_counter() - t)
            t = time.perf_counter()
            caster.publish(state, v)  # no member: the staging copy alone, as the trainer sees it
            broadcast.append(time.perf_counter() - t)
        sender.close()
        caster.close()
    finally:
        ray.shutdown()
    result = {
        "state_bytes": nbytes,
        "local_shm_publish_s": statistics.median(local),
        "object_store_blocking_publish_s": statistics.median(cluster),
        "broadcast_blocking_publish_s": statistics.median(broadcast),
    }
    result["ratio"] = result["object_store_blocking_publish_s"] / result["local_shm_publish_s"]
    result["broadcast_ratio"] = result["broadcast_blocking_publish_s"] / result["local_shm_publish_s"]
    print(
        f"blocking push of {nbytes / MB:.1f} MB: local shm {result['local_shm_publish_s'] * 1e3:.2f} ms, "
        f"object store (staging copy) {result['object_store_blocking_publish_s'] * 1e3:.2f} ms "
        f"({result['ratio']:.2f}x), broadcast (staging copy) {result['broadcast_blocking_publish_s'] * 1e3:.2f} ms "
        f"({result['broadcast_ratio']:.2f}x)",
        flush=True,
    )
    return result


# the local placement lends the generator's idle threads to the trainer by default (one replica:
# pipeline.lend_idle_cores, orchestrate/lending.py); Ray placement does not (lending to a replica
# on the trainer's node was tried and measured slower, docs/distributed.md); local is read
# without it too, so that Ray's own overhead shows apart from the lending's
VARIANTS = {
    "local": ["--cluster.placement", "local"],
    "ray": ["--cluster.placement", "ray"],
    "local_no_lending": ["--cluster.placement", "local", "--pipeline.lend_idle_cores", "false"],
}


def step_times(steps: int, jobs: list[str], rounds: int) -> dict:
    """Mean perf/step_s (steps after the first) of each job at one replica, budget 1, local and
    Ray placement interleaved for `rounds` rounds; per job the ratio of the medians over rounds."""
    out: dict = {}
    work = Path(tempfile.mkdtemp(prefix="gapless-bench-steps-"))
    for job in jobs:
        config = [str(ROOT / "configs" / f"{job}.toml")] if job != "default" else []  # default: the embedded job
        means: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for round_ in range(rounds):
            for variant, extra in VARIANTS.items():
                run = work / f"{job}-{variant}-{round_}"
                args = [
                    sys.executable,
                    "-m",
                    "gapless.cli",
                    "train",
                    *config,
                    "--run-dir",
                    str(run),
                    "--warmstart.cache_dir",
                    str(work / "warm"),
                    "--loop.steps",
                    str(steps),
                    "--loop.eval_every",
                    "1000",
                    "--pipeline.max_staleness",
                    "1",
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
                subprocess.run(
                    args, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src"))
                )
                rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                per_step = [r["perf/step_s"] for r in rows if "perf/step_s" in r][1:]
                means[variant].append(statistics.mean(per_step))
                print(
                    f"s/step {job} {variant} round {round_ + 1}: {means[variant][-1]:.3f} (mean of {len(per_step)})",
                    flush=True,
                )
        m = {variant: statistics.median(v) for variant, v in means.items()}
        out[job] = {
            **m,
            "ratio": m["ray"] / m["local"],
            "ratio_no_lending": m["ray"] / m["local_no_lending"],
            "rounds": means,
        }
        print(
            f"s/step {job}: ray {m['ray']:.3f} / local {m['local']:.3f} = {out[job]['ratio']:.2f}x; against local "
            f"without lending {m['local_no_lending']:.3f}: {out[job]['ratio_no_lending']:.2f}x",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4,8,16,64")
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--push-reps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument(
        "--step-jobs", default="smoke,default", help="steps part: configs/NAME.toml, or default (the embedded job)"
    )
    parser.add_argument("--step-rounds", type=int, default=2)
    parser.add_argument("--parts", default="push,relay,steps", help="which of push, relay (and detection), steps")
    parser.add_argument("--transports", default="object_store,broadcast", help="relay part: which transports")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    result = {"cores": len(os.sched_getaffinity(0)), "load_avg_start": os.getloadavg()[0], "reps": args.reps}
    if "push" in parts:
        result["push"] = blocking_push(args.push_reps)
    if "relay" in parts:
        result.update(
            relay_and_failures(
                [int(s) for s in args.sizes.split(",")], args.held_out, args.reps, tuple(args.transports.split(","))
            )
        )
    if "steps" in parts:
        result["s_per_step"] = step_times(args.steps, args.step_jobs.split(","), args.step_rounds)
    result["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
