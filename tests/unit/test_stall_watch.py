"""The stall watch's rule (cluster/watchdog.py): a stall is an actor without progress.

- an actor process that keeps marking progress is no stall however long the trainer waits with
  nothing arriving; the same process, still beating, stops progressing: a stall within the
  timeout, whose record names its last progress (a real process writing shared memory);
- the wait is stuck only when no actor it waits on progressed: one idle actor (the environment
  while the generator decodes) is waiting, not stalled; the trainer's own work before a wait is
  no actor's silence;
- a mark's text is cut to its room, never spilling into the next actor's.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import time

import pytest

from gapless.cluster.watchdog import WHAT_BYTES, Heartbeats, PipelineStalled, StallWatch


def _actor(beats: Heartbeats, keep_progressing) -> None:
    """A generator stand-in: beats every 20 ms, and marks a decode step with each beat while
    `keep_progressing` is set (after that it loops alive doing nothing: a livelock)."""
    beats.register("generator")
    step = 0
    while True:
        beats.beat("generator")
        if keep_progressing.value:
            step += 1
            beats.progress("generator", f"decoded 4 tokens (step {step})")
        time.sleep(0.02)


def test_a_progressing_actor_is_no_stall_and_a_live_one_without_progress_is(tmp_path):
    timeout_s = 1.5
    ctx = mp.get_context("spawn")
    beats = Heartbeats(ctx, ("generator",))
    keep = ctx.RawValue("b", 1)
    actor = ctx.Process(target=_actor, args=(beats, keep), daemon=True)
    actor.start()
    try:
        deadline = time.monotonic() + 60
        while beats.last_progress("generator").marks == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beats.last_progress("generator").marks > 0, "the actor process never marked progress"
        watch = StallWatch(beats, timeout_s, tmp_path, ("generator",))
        watch.progressed()  # the wait starts; nothing arrives during it
        waited_until = time.monotonic() + 2.5 * timeout_s
        while time.monotonic() < waited_until:
            watch.check("step 1's rollouts")  # the old rule ("no group arrived for timeout_s") raised here
            time.sleep(0.05)
        keep.value = 0
        stopped = time.monotonic()
        with pytest.raises(PipelineStalled, match="waiting on generator, which made no progress for") as stall:
            while time.monotonic() - stopped < timeout_s + 30:
                watch.check("step 1's rollouts")
                time.sleep(0.05)
        assert time.monotonic() - stopped >= timeout_s - 0.1  # not before its progress had stopped for the timeout
        record = (tmp_path / "stall.txt").read_text()
        assert str(stall.value) == record.rstrip("\n")
        line = re.search(
            r"generator: pid (\d+), last heartbeat ([\d.]+) s ago, state (\S+).*; progress mark (\d+), "
            r"the last ([\d.]+) s ago \(at [\d:]+\): decoded 4 tokens \(step (\d+)\)",
            record,
        )
        assert line, record
        assert int(line.group(1)) == actor.pid and line.group(3) != "T"
        assert float(line.group(2)) < timeout_s  # alive and beating: found by its progress, not its silence
        assert float(line.group(5)) >= timeout_s - 0.1 and int(line.group(4)) == int(line.group(6))
    finally:
        actor.kill()
        actor.join()


def test_the_wait_stalls_only_when_no_actor_it_waits_on_progressed(tmp_path):
    beats = Heartbeats(mp.get_context("spawn"), ("generator", "environment"))
    watch = StallWatch(beats, 1.0, tmp_path, ("generator", "environment"))
    now = time.monotonic()
    # both actors last progressed 5 s ago, during the trainer's step (the generator held by the budget)
    beats._progress_at[0] = beats._progress_at[1] = now - 5.0
    watch.progressed()
    watch.check("step 2's rollouts")  # the trainer's own work before this wait is no actor's silence
    beats.progress("generator", "decoded 8 tokens")
    watch.progress_at = now - 3.0  # the wait began 3 s ago, nothing arrived since
    beats._progress_at[0] = now - 0.5  # the generator decodes; the environment has nothing to score yet
    watch.check("step 2's rollouts")
    beats._progress_at[0] = now - 1.2  # now neither progresses
    with pytest.raises(PipelineStalled) as stall:
        watch.check("step 2's rollouts")
    message = str(stall.value)
    assert "waiting on generator and environment, none of which made progress for 1.2 s" in message
    assert re.search(r"generator: pid 0, .*; progress mark 1, the last 1\.2 s ago .*: decoded 8 tokens", message), (
        message
    )
    assert re.search(r"environment: pid 0, .*; no progress since it started 5\.0 s ago", message), message


def test_a_marks_text_stays_in_its_room():
    beats = Heartbeats(mp.get_context("spawn"), ("generator", "environment"))
    beats.progress("environment", "scored group 7")
    beats.progress("generator", "x" + "é" * WHAT_BYTES)  # 'é' is two bytes: the cut falls inside one
    assert beats.last_progress("environment").what == "scored group 7"
    generator = beats.last_progress("generator")
    assert generator.marks == 1 and generator.what == "x" + "é" * (WHAT_BYTES // 2 - 1) + "\ufffd"
