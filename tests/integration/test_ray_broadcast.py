"""The broadcast weight relay (orchestrate/ray_broadcast.py) between this process (the trainer,
rank 0) and receiver processes spawned here, over gloo on loopback; no Ray (slow: each receiver
imports torch).

Checked: every version a receiver exposes is newer than the last and whole (each version fills
every tensor with its number, bf16 included), the newest reaches every member and equals the
trainer's state; the trainer's publish never waits for a receiver; a member killed with SIGKILL
and dropped (as the placement's kill does) makes the relay rebuild the group and the survivor
keeps receiving; no process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from gapless.orchestrate.ray_broadcast import BroadcastSender, BroadcastWeights

pytestmark = pytest.mark.slow


def _state(v: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 33), float(v)), "b": torch.full((7,), float(v), dtype=torch.bfloat16),
            "n": torch.full((3,), v, dtype=torch.int64)}


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


def test_versions_reach_every_member_monotonic_and_whole_and_a_killed_member_is_dropped():
    sender = BroadcastSender(_state(0), op_timeout_s=5.0, rendezvous_timeout_s=60.0, host="127.0.0.1", log=lambda m: None)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    try:
        sender.publish(_state(1), 1)
        for name in ("generator-0", "generator-1"):
            handle = BroadcastWeights(sender, name)
            sender.expect(name)
            p = ctx.Process(target=_receiver, args=(handle, 30 if name == "generator-0" else 10 ** 9, out), daemon=True)
            p.start()
            procs.append(p)
        assert sender.wait_relayed(1, 90), sender.error
        waits = []
        for v in range(2, 11):
            waits.append(sender.publish(_state(v), v))
            time.sleep(0.05)
        assert sender.wait_relayed(10, 30), sender.error
        assert max(waits) < 1.0  # a local copy (it waits at most for one send of the other half)
        os.kill(procs[1].pid, signal.SIGKILL)
        sender.drop("generator-1")
        for v in range(11, 31):
            sender.publish(_state(v), v)
            time.sleep(0.05)
        assert sender.wait_relayed(30, 60), (sender.error, sender.dropped)
        member, seen = out.get(timeout=60)
        assert member == "generator-0" and seen[-1] == 30
        assert seen == sorted(set(seen)) and seen[0] >= 1  # monotonic
        assert sender.epochs >= 2  # rebuilt without the killed member
        assert sender.error is None
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not any(p.is_alive() for p in procs)
