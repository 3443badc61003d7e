"""Core lending between the generator and the trainer: the handshake and the layer hooks."""

import multiprocessing as mp
import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from gapless.config import ModelConfig
from gapless.models import build_tiny
from gapless.orchestrate.actors import _GeneratorActor
from gapless.orchestrate.lending import LendingFlags, TrainerLending


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _lending(own=1, lent=1):
    torch.set_num_threads(own)
    return TrainerLending(LendingFlags(mp.get_context("spawn")), own, lent)


def test_the_trainer_borrows_only_inside_a_step_and_while_not_wanted():
    lending = _lending()
    lending.check()  # outside a step: nothing happens
    assert torch.get_num_threads() == 1 and not lending.held
    with lending.borrowing():
        lending.check()
        assert torch.get_num_threads() == 2 and lending.held
        lending.flags._flags[0] = 1  # the generator wants its thread
        lending.check()
        assert torch.get_num_threads() == 1 and not lending.held
        lending.flags.idle()
        lending.check()
        assert lending.held
    assert torch.get_num_threads() == 1 and not lending.held and lending.flags._flags[1] == 0  # given back on exit
    assert lending.borrowed_frac() == 2 / 3


def test_the_generator_waits_for_its_threads_until_the_next_check_and_never_longer_than_its_bound():
    lending = _lending()
    with lending.borrowing():
        lending.check()
        assert lending.held
        waited = lending.flags.want(max_wait_s=0.05)  # nobody checks: it gives up after the bound
        assert 0.05 <= waited < 0.5
        lending.check()  # the trainer's next layer boundary hands the thread back
        assert not lending.held and lending.flags.want(max_wait_s=1.0) == 0.0

        lending.flags.idle()
        lending.check()
        assert lending.held
        timer = threading.Timer(0.05, lending.check)  # a layer boundary 50 ms from now
        timer.start()
        waited = lending.flags.want(max_wait_s=5.0)
        timer.join()
        assert 0.04 < waited < 1.0 and not lending.held


def test_hooks_check_at_every_decoder_layer_forward_and_backward(problems):
    policy = build_tiny(
        ModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300),
        [p.prompt for p in problems[:20]],
        seed=0,
    )
    lending = _lending()
    assert lending.install(policy.model) == 3
    ids = torch.tensor([policy.encode(problems[0].prompt)])
    with lending.borrowing():
        policy.model(input_ids=ids).logits.sum().backward()
    assert lending.checks == 6  # 3 layers, forward and backward
    assert lending.borrowed_frac() == 1.0 and torch.get_num_threads() == 1
    with torch.no_grad(), lending.borrowing():
        policy.model(input_ids=ids)
    assert lending.checks == 3  # no backward hooks without gradients
    assert lending.install(torch.nn.Linear(2, 2)) == 0  # no decoder layers: nothing hooked


def test_a_replica_blocked_on_a_full_queue_to_the_environment_lends_its_threads():
    flags = LendingFlags(mp.get_context("spawn"))
    actor = _GeneratorActor.__new__(_GeneratorActor)  # only its queue-to-the-environment half
    actor.spec = SimpleNamespace(lending=flags, stop=threading.Event())
    actor._beat = lambda: None
    to_env = queue.Queue(maxsize=1)
    flags.want(max_wait_s=0.0)  # decoding
    assert actor._to_env(to_env, "first") == 0.0 and flags.wanted  # room: nothing changes
    seen = []

    def drain():
        seen.append(flags.wanted)
        to_env.get()

    timer = threading.Timer(0.2, drain)
    timer.start()
    blocked = actor._to_env(to_env, "second")  # full: blocks until drained
    timer.join()
    assert seen == [False] and 0.15 < blocked < 5.0 and to_env.get_nowait() == "second"


def _score_in_child(flags, entered, release) -> None:
    with flags.scoring():
        entered.set()
        release.wait(30)


def test_the_trainer_hands_the_threads_back_while_an_environment_process_scores():
    """pipeline.lend_while_scoring = false: a group being scored in another process counts as a
    generator that wants its threads; true: the trainer borrows through it."""
    ctx = mp.get_context("spawn")
    lending = _lending()
    entered, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_score_in_child, args=(lending.flags, entered, release))
    child.start()
    try:
        assert entered.wait(60)
        assert lending.flags.environment_busy
        with lending.borrowing():
            lending.check()
            assert not lending.held and torch.get_num_threads() == 1
            lending.while_scoring = True
            lending.check()
            assert lending.held and torch.get_num_threads() == 2
            lending.while_scoring = False
            lending.check()  # the next layer boundary gives them back
            assert not lending.held and torch.get_num_threads() == 1
            release.set()
            child.join(30)
            assert not lending.flags.environment_busy  # the count fell back when the scoring ended
            lending.check()
            assert lending.held
    finally:
        release.set()
        child.join(30)


def test_the_scoring_count_is_exact_under_concurrent_workers():
    flags = LendingFlags(mp.get_context("spawn"))
    seen = []

    def worker():
        for _ in range(300):
            with flags.scoring():
                seen.append(flags._scoring.value)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert flags._scoring.value == 0 and not flags.environment_busy
    assert 1 <= min(seen) and max(seen) <= 4
    with pytest.raises(RuntimeError):
        with flags.scoring():
            raise RuntimeError("a failed scoring still leaves the count")
    assert flags._scoring.value == 0
