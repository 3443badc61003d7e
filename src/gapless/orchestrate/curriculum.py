"""Pass-rate curriculum: prefer prompts that are neither always solved nor never solved.

Each prompt keeps a running pass rate p (Beta(1, 1) prior, then the mean reward of its groups,
with older evidence decayed by `decay` per update). A prompt is drawn with weight
p * (1 - p) + floor, so a group of N samples of it is likely to have reward variance (GRPO's
signal), while unseen prompts (p = 0.5 under the prior) are explored first and solved or hopeless
ones are revisited rarely (the floor), in case the policy has changed.

Guaranteed: deterministic for a given seed and sequence of updates; every prompt keeps a
non-zero probability. Not guaranteed: a step-by-step optimum; the weights reflect past policies.
"""

from __future__ import annotations

import random
from typing import Sequence


class PassRateCurriculum:
    def __init__(self, uids: Sequence[str], seed: int, floor: float = 0.02, decay: float = 0.5):
        self.uids = list(uids)
        self.rng = random.Random(f"{seed}-curriculum")
        self.floor, self.decay = floor, decay
        self.passed = {uid: 1.0 for uid in self.uids}  # Beta(1, 1) prior: one pass, one fail
        self.seen = {uid: 2.0 for uid in self.uids}

    def pass_rate(self, uid: str) -> float:
        return self.passed[uid] / self.seen[uid]

    def weight(self, uid: str) -> float:
        p = self.pass_rate(uid)
        return p * (1.0 - p) + self.floor

    def pick(self) -> int:
        weights = [self.weight(uid) for uid in self.uids]
        return self.rng.choices(range(len(self.uids)), weights=weights)[0]

    def update(self, uid: str, rewards: list[float]) -> None:
        if uid not in self.passed or not rewards:
            return
        self.passed[uid] = self.passed[uid] * self.decay + sum(rewards)
        self.seen[uid] = self.seen[uid] * self.decay + len(rewards)
