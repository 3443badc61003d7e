"""Partial rollouts: cut running groups at a token or time deadline and resume them later.

While sequences wait for a slot, a group running past its deadline is aborted (`engine.abort`)
and queued again at the back (`engine.resume`): the sequences that waited get its slots, and the
cut group continues later, its context re-prefilled by whichever weights are current then. Its
tokens keep the policy versions that sampled them, so staleness (counted from a rollout's oldest
token) and the off-policy corrections see exactly which policy wrote what.

Two deadlines, each off at 0 (either alone or both):
    every_tokens  a group is cut when one of its sequences has just produced a multiple of K tokens
    deadline_s    a group is cut when it has been running for this long since it last got a slot
                  (a segment's clock starts at the first step the group is seen running)
Guaranteed: nothing is cut while no sequence waits (cutting then would only re-prefill for
nothing); a cut never loses a token, log-prob or version. Not guaranteed: a time deadline depends
on the machine's speed, so runs that cut by time are not bitwise reproducible.
Needs an engine that exposes its running sequences (the torch engine).
"""

from __future__ import annotations

import time
from typing import Callable

from gapless.types import SamplingParams


class PartialRollouts:
    def __init__(self, every_tokens: int = 0, deadline_s: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        self.every_tokens = every_tokens
        self.deadline_s = deadline_s
        self.clock = clock
        self.running_since: dict[str, float] = {}  # request id -> start of its current segment

    @property
    def enabled(self) -> bool:
        return bool(self.every_tokens or self.deadline_s)

    def cut(self, engine, params_for: Callable[[str], SamplingParams]) -> list[str]:
        """Call after each engine step; returns the request ids cut (in running order)."""
        if not self.enabled:
            return []
        now = self.clock()
        running = dict.fromkeys(seq.request_id for seq in engine.running)
        self.running_since = {rid: self.running_since.get(rid, now) for rid in running}
        if not engine.num_waiting:
            return []
        due = set()
        if self.every_tokens:
            due |= {seq.request_id for seq in engine.running if seq.tokens and len(seq.tokens) % self.every_tokens == 0}
        if self.deadline_s:
            due |= {rid for rid, since in self.running_since.items() if now - since >= self.deadline_s}
        ids = [rid for rid in running if rid in due]
        for request_id in ids:
            engine.resume(engine.abort([request_id]), params_for(request_id), request_id)
            del self.running_since[request_id]
        return ids
