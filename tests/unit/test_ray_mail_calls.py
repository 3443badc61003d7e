"""The Ray mailbox's call gate and heartbeat ages (cluster/ray/mail.py), without a Ray instance:
the Ray calls are replaced at `ray.get` / `ray.is_initialized`, the logic under test is the real one.

- quiesce refuses new calls and waits for the one in flight (ray.shutdown under a thread inside
  ray.get crashed the run's process at exit); reopen lets a new connection call again;
- a stall of the mailbox (no read answered for seconds) is not counted as the actors' silence,
  while an actor whose beats stop while the mailbox answers still ages;
- progress is seen by its marks, not by beats: an actor that beats on without marking ages in
  progress; a stalled mailbox is no lack of progress either; an actor's pusher sends its marks
  and what the last was about, also when only they changed;
- a timed-out read does not end the trainer's poller;
- a channel whose mailbox calls time out after the mailbox acted (the answer lost on the way)
  still delivers every item once, in order, and such a timeout does not stop an actor (the real
  PostOffice, run on an event loop in this process); the mailbox is given pickled bytes only.
"""

import asyncio
import os
import queue
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from gapless.cluster.ray import mail as ray_mail  # noqa: E402


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.get returns what make_ref made after `delay[0]` seconds (or raises it if an exception)."""
    delay = [0.0]

    def get(value, timeout=None):
        time.sleep(delay[0])
        if isinstance(value, BaseException):
            raise value
        return value

    monkeypatch.setattr(ray_mail.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_mail.ray, "get", get)
    ray_mail.reopen()  # as after ray.init (an earlier run in this process may have quiesced)
    yield delay
    ray_mail.reopen()


def test_quiesce_waits_for_the_call_in_flight_and_refuses_new_ones(fake_ray):
    fake_ray[0] = 0.4
    done = []
    caller = threading.Thread(target=lambda: done.append(ray_mail._call(lambda: "answer")))
    caller.start()
    time.sleep(0.1)  # the call is inside ray.get now
    start = time.monotonic()
    assert ray_mail.quiesce(timeout_s=5.0)
    assert time.monotonic() - start >= 0.2 and done == ["answer"]
    with pytest.raises(ConnectionError):
        ray_mail._call(lambda: "late")
    ray_mail.reopen()
    fake_ray[0] = 0.0
    assert ray_mail._call(lambda: "again") == "again"
    caller.join()


def test_quiesce_gives_up_after_its_timeout(fake_ray):
    fake_ray[0] = 1.0
    caller = threading.Thread(target=lambda: ray_mail._call(lambda: "slow"))
    caller.start()
    time.sleep(0.1)
    assert ray_mail.quiesce(timeout_s=0.1) is False
    caller.join()


class _Office:
    """read_beats answers the records set in `beats`; `fail` makes the next read time out."""

    def __init__(self):
        self.beats, self.fail = {}, False
        self.read_beats = self

    def remote(self):
        if self.fail:
            self.fail = False
            return ray.exceptions.GetTimeoutError("slow mailbox")
        return dict(self.beats)


def test_a_mailbox_stall_is_not_the_actors_silence(fake_ray):
    office = _Office()
    beats = ray_mail.RayHeartbeats(office, ("generator-0", "generator-1"))
    office.beats = {"generator-0": (1, "h", 10), "generator-1": (1, "h", 11)}
    beats._read()
    time.sleep(0.3)
    office.beats["generator-0"] = (2, "h", 10)  # generator-0 beats on; generator-1 is silent from now
    beats._read()
    assert beats._seen["generator-0"][0] == (2, "h", 10)
    # generator-1 was last seen 6 s ago, and for the last 5 s no read was answered (a stalled mailbox)
    now = time.monotonic()
    beats._seen["generator-1"] = (beats._seen["generator-1"][0], now - 6.0)
    beats._read_at = now - 5.0
    beats._read()
    assert beats.age_s("generator-1") == pytest.approx(6.0 - (5.0 - 2 * ray_mail.PUSH_S), abs=0.1)
    assert beats.age_s("generator-0") < 1.0
    credited = beats._seen["generator-1"][1]
    time.sleep(0.3)  # the mailbox answers again and generator-1 still does not beat: it ages
    beats._read()
    assert beats._seen["generator-1"][1] == credited and beats.age_s("generator-1") > 1.6


def test_progress_is_seen_by_its_marks_not_by_beats(fake_ray):
    office = _Office()
    beats = ray_mail.RayHeartbeats(office, ("generator",))
    office.beats = {"generator": (1, "h", 10, 1, "decoded 4 tokens")}
    beats._read()
    marked = beats._progress_seen["generator"]
    assert marked[:2] == (1, "decoded 4 tokens")
    time.sleep(0.3)
    office.beats = {"generator": (2, "h", 10, 1, "decoded 4 tokens")}  # beats on, marks nothing: a livelock
    beats._read()
    assert beats._seen["generator"][0][0] == 2 and beats._progress_seen["generator"] == marked
    # its last mark was 6 s ago, and for the last 5 s no read was answered (a stalled mailbox)
    now = time.monotonic()
    beats._progress_seen["generator"] = (1, "decoded 4 tokens", now - 6.0)
    beats._read_at = now - 5.0
    beats._read()
    assert beats._progress_seen["generator"][2] == pytest.approx(now - 6.0 + 5.0 - 2 * ray_mail.PUSH_S, abs=0.1)
    office.beats = {"generator": (3, "h", 10, 2, "applied weights version 1")}
    beats._read()
    progress = beats.last_progress("generator")
    assert (progress.marks, progress.what) == (2, "applied weights version 1") and progress.age_s < 1.0
    assert beats.progress_age_s("generator") < 1.0 and beats.pid("generator") == 0  # pid 0: host 'h' is not this one


class _BeatSink:
    """An office whose `beat` calls are recorded."""

    def __init__(self):
        self.sent: list[dict] = []
        self.beat = self

    def remote(self, records):
        self.sent.append(dict(records))


def test_an_actor_pushes_its_marks_with_its_beats(fake_ray, monkeypatch):
    monkeypatch.setattr(ray_mail, "PUSH_S", 0.02)
    office = _BeatSink()
    beats = ray_mail.RayHeartbeats(office, ("generator",))

    def pushed(marks: int) -> tuple:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            records = [r["generator"] for r in office.sent if "generator" in r and r["generator"][3] == marks]
            if records:
                return records[-1]
            time.sleep(0.02)
        raise AssertionError(f"no record with {marks} marks pushed: {office.sent[-3:]}")

    beats.register("generator")
    beats.progress("generator", "decoded 8 tokens")
    assert pushed(1)[1:] == (ray_mail.HOST, os.getpid(), 1, "decoded 8 tokens")
    beats.progress("generator", "decoded 2 tokens")  # no beat between: the mark alone is news
    assert pushed(2)[3:] == (2, "decoded 2 tokens")
    ray_mail.quiesce(timeout_s=1.0)  # ends the pusher at its next call


def test_a_timed_out_read_does_not_end_the_poller(fake_ray, monkeypatch):
    office = _Office()
    beats = ray_mail.RayHeartbeats(office, ("generator-0",))
    monkeypatch.setattr(ray_mail, "PUSH_S", 0.02)
    office.fail = True
    poller = threading.Thread(target=beats._poll, daemon=True)
    poller.start()
    time.sleep(0.2)
    office.beats = {"generator-0": (7, "h", 1)}
    deadline = time.monotonic() + 5.0
    while beats._seen["generator-0"][0] != (7, "h", 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert poller.is_alive() and beats._seen["generator-0"][0] == (7, "h", 1)
    ray_mail.quiesce(timeout_s=1.0)  # ends the poller at its next call
    poller.join(timeout=5.0)
    assert not poller.is_alive()


class _LocalOffice:
    """The real PostOffice on an event loop in a thread. `office.method.remote(*args)` runs the
    call there and returns its answer, or, while `lose[method]` > 0, a GetTimeoutError instead: the
    mailbox acted, the caller never heard (fake_ray's get raises it)."""

    def __init__(self, lose: dict[str, int]):
        self.real, self.lose = ray_mail.PostOffice.__ray_actor_class__(), dict(lose)
        self.put_types: set[type] = set()  # the types of the items the mailbox was given
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __getattr__(self, name):
        office = self

        class _Method:
            @staticmethod
            def remote(*args):
                if name == "put_many":
                    office.put_types.update(type(item) for item in args[2])
                answer = asyncio.run_coroutine_threadsafe(getattr(office.real, name)(*args), office.loop).result()
                if office.lose.get(name, 0) > 0:
                    office.lose[name] -= 1
                    return ray.exceptions.GetTimeoutError("the answer came too late")
                return answer

        return _Method

    def close(self):
        ray_mail.quiesce(timeout_s=5.0)  # the channel's threads end at their next call
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)


@pytest.mark.parametrize("maxsize", [0, 3])
def test_a_channel_loses_and_duplicates_nothing_when_calls_time_out(fake_ray, maxsize):
    office = _LocalOffice({"put_many": 3, "get_many": 4})
    channel = ray_mail.RayChannel(office, maxsize)
    try:
        received = []
        writer = threading.Thread(target=lambda: [channel.put(i, timeout=10) or time.sleep(0.002) for i in range(40)])
        writer.start()
        while len(received) < 40:
            received.append(channel.get(timeout=10))
        writer.join()
        assert received == list(range(40))  # every item once, in order
        with pytest.raises(queue.Empty):
            channel.get(timeout=0.7)  # no duplicate follows
        assert office.lose == {"put_many": 0, "get_many": 0}  # the lost answers happened
        # opaque bytes: unpickling a message in the mailbox would import gapless and torch in its event loop
        assert office.put_types == {bytes}
    finally:
        office.close()


def test_a_timed_out_stop_poll_does_not_stop_the_actor(fake_ray, monkeypatch):
    monkeypatch.setattr(ray_mail, "POLL_S", 0.05)
    office = _LocalOffice({"wait_stop": 2})
    flag = ray_mail.RayStopFlag(office)
    try:
        assert not flag.wait(1.0)
        assert office.lose["wait_stop"] == 0 and not flag.is_set()  # two polls lost: still running
        asyncio.run_coroutine_threadsafe(office.real.set_stop(), office.loop).result()
        assert flag.wait(5.0)  # the trainer's stop still arrives
    finally:
        office.close()


def _refuse_to_load():
    raise ImportError("No module named 'a_module_only_the_writer_has'")


class _OnlyTheWriterCanLoad:
    """Pickles fine; unpickling fails, as a message does on a node that runs different code."""

    def __reduce__(self):
        return _refuse_to_load, ()


def test_an_item_the_reader_cannot_unpickle_raises_in_order_and_the_rest_still_arrive(fake_ray):
    office = _LocalOffice({})
    channel = ray_mail.RayChannel(office)
    try:
        for item in (1, _OnlyTheWriterCanLoad(), 3):
            channel.put(item)
        assert channel.get(timeout=10) == 1
        with pytest.raises(ray_mail.ChannelError, match="a_module_only_the_writer_has.*same gapless"):
            channel.get(timeout=10)
        assert channel.get(timeout=10) == 3
    finally:
        office.close()
