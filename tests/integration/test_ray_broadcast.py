"""The broadcast weight relay (cluster/ray/broadcast.py) between this process (the trainer,
rank 0) and receiver processes spawned here, over gloo on loopback; no Ray (slow: each receiver
imports torch).

Checked: every version a receiver exposes is newer than the last and whole (each version fills
every tensor with its number, bf16 included), the newest reaches every member and equals the
trainer's state; the trainer's publish never waits for a receiver; a member killed with SIGKILL
and dropped (as the placement's kill does), or not dropped and found without an answer by the
relay, makes the relay rebuild the group without it alone and the survivor keeps receiving; no process is left behind. Fast: a replica that never joins makes the trainer's
next publish raise naming it and the timeout, and a replica never admitted raises naming itself
and the trainer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest
import torch

from gapless.cluster.ray.broadcast import BroadcastSender, BroadcastWeights, RelayTimeout


def _state(v: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.full((64, 33), float(v)),
        "b": torch.full((7,), float(v), dtype=torch.bfloat16),
        "n": torch.full((3,), v, dtype=torch.int64),
    }


def _receiver(handle: BroadcastWeights, until: int, out) -> None:
    seen: list[int] = []

    def load(views, version):
        values = {float(t.float().min()) for t in views.values()} | {float(t.float().max()) for t in views.values()}
        assert values == {float(version)}, (version, values)  # whole: never torn
        seen.append(version)

    have = -1
    deadline = time.monotonic() + 120
    while (not seen or seen[-1] < until) and time.monotonic() < deadline:
        got = handle.fetch_into(load, have)
        if got is not None:
            have = got
        time.sleep(0.01)
    out.put((handle.member, seen))
    time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("evicted", [True, False], ids=["evicted", "found-silent"])
def test_versions_reach_every_member_monotonic_and_whole_and_a_killed_member_is_dropped(evicted):
    """evicted: the placement's kill drops the member; found-silent: nobody tells the relay, which
    finds the member without an answer and drops it alone (the survivor answered)."""
    sender = BroadcastSender(
        _state(0), op_timeout_s=3.0, rendezvous_timeout_s=60.0, host="127.0.0.1", log=lambda m: None
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    try:
        sender.publish(_state(1), 1)
        for name in ("generator-0", "generator-1"):
            handle = BroadcastWeights(sender, name)
            sender.expect(name)
            p = ctx.Process(target=_receiver, args=(handle, 30 if name == "generator-0" else 10**9, out), daemon=True)
            p.start()
            procs.append(p)
        assert sender.wait_relayed(1, 90), sender.error
        deadline = time.monotonic() + 90
        while "generator-1" not in sender.flips and time.monotonic() < deadline:  # both in the group
            time.sleep(0.05)
        assert "generator-1" in sender.flips, (sender.flips, sender.error)
        waits = []
        for v in range(2, 11):
            waits.append(sender.publish(_state(v), v))
            time.sleep(0.05)
        assert sender.wait_relayed(10, 30), sender.error
        assert max(waits) < 1.0  # a local copy (it waits at most for one send of the other half)
        epochs = sender.epochs
        os.kill(procs[1].pid, signal.SIGKILL)
        if evicted:
            sender.drop("generator-1")
        for v in range(11, 31):
            sender.publish(_state(v), v)
            time.sleep(0.05)
        assert sender.wait_relayed(30, 90), (sender.error, sender.dropped)
        assert [m for m, _ in sender.dropped] == ([] if evicted else ["generator-1"]), sender.dropped
        member, seen = out.get(timeout=60)
        assert member == "generator-0" and seen[-1] == 30
        assert seen == sorted(set(seen)) and seen[0] >= 1  # monotonic
        assert sender.epochs > epochs  # rebuilt without the killed member
        assert sender.error is None
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not any(p.is_alive() for p in procs)


def test_a_replica_that_never_joins_fails_the_next_publish_naming_it():
    sender = BroadcastSender(
        _state(0), op_timeout_s=0.5, rendezvous_timeout_s=1.0, host="127.0.0.1", log=lambda m: None
    )
    try:
        sender.expect("generator-7")
        deadline = time.monotonic() + 10
        while sender.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError) as err:
            sender.publish(_state(1), 1)
        assert isinstance(err.value.__cause__, RelayTimeout)
        assert "generator-7" in str(err.value) and "cluster.rendezvous_timeout_s" in str(err.value), str(err.value)
    finally:
        sender.close()


def test_a_replica_never_admitted_names_itself_and_the_trainer():
    sender = BroadcastSender(
        _state(0), op_timeout_s=0.5, rendezvous_timeout_s=1.0, host="127.0.0.1", log=lambda m: None
    )
    try:
        receiver = pickle.loads(pickle.dumps(BroadcastWeights(sender, "generator-3")))  # never expected: never admitted
        start = time.monotonic()
        with pytest.raises((RelayTimeout, RuntimeError)) as err:
            receiver.fetch_into(lambda views, version: None, -1)
        assert time.monotonic() - start < 5
        assert "generator-3" in str(err.value) and "trainer" in str(err.value), str(err.value)
        assert "cluster.rendezvous_timeout_s" in str(err.value), str(err.value)
    finally:
        receiver._closed = True
        sender.close()
