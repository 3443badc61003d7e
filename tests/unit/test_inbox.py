"""The trainer's inbox (orchestrate/inbox.py): messages of one kind handled on a helper thread
while the trainer is busy, the others kept back in order for its next read."""

from __future__ import annotations

import queue
import threading

import pytest

from gapless.orchestrate.inbox import Inbox
from gapless.orchestrate.messages import GenStats, Loaded


def test_one_kind_is_handled_meanwhile_and_the_rest_kept_in_order():
    inbox, handled, seen = Inbox(), [], threading.Event()

    def handle(message):
        handled.append(message)
        if len(handled) == 2:
            seen.set()

    inbox.put(GenStats({"a": 1.0}))  # arrived before the span: kept for the next get too
    with inbox.meanwhile(Loaded, handle):
        inbox.put(Loaded(0, 1))
        inbox.put(GenStats({"b": 2.0}))
        inbox.put(Loaded(0, 2))
        assert seen.wait(10)  # handled while the caller is still inside the span
    inbox.put(GenStats({"c": 3.0}))
    assert handled == [Loaded(0, 1), Loaded(0, 2)]
    assert [inbox.get(0.1).stats for _ in range(3)] == [{"a": 1.0}, {"b": 2.0}, {"c": 3.0}]
    with pytest.raises(queue.Empty):
        inbox.get(0.01)


def test_a_failing_handler_is_raised_in_the_caller_and_later_messages_are_kept():
    inbox = Inbox()

    def handle(message):
        raise RuntimeError(f"cannot admit at version {message.version}")

    with pytest.raises(RuntimeError, match="version 1"):
        with inbox.meanwhile(Loaded, handle):
            inbox.put(Loaded(0, 1))
            inbox.put(Loaded(0, 2))
    assert inbox.get(0.1) == Loaded(0, 2)


def test_an_empty_span_returns_at_once_and_leaves_nothing_behind():
    inbox = Inbox()
    for _ in range(100):
        with inbox.meanwhile(Loaded, lambda m: None):
            pass
    with pytest.raises(queue.Empty):
        inbox.get(0.01)
    assert not [t for t in threading.enumerate() if t.name == "gapless-inbox"]
