"""An environment wrapper that adds latency without using CPU, like a remote judge or a slow
sandbox start: each group waits `delay_s` before it is scored, at most `concurrency` groups at
a time. Used by the pipeline benchmark to measure how much of such latency asynchrony hides."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from gapless.types import Completion, Rollout


class DelayedEnvironment:
    def __init__(self, env, delay_s: float, concurrency: int):
        self.env, self.delay_s = env, delay_s
        self.name = getattr(env, "name", type(env).__name__)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="delay")

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    def score_groups(self, tasks: Sequence, groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        def one(task, completions):
            time.sleep(self.delay_s)
            return self.env.score_groups([task], [completions])[0]

        return list(self._pool.map(one, tasks, groups))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.env.close()
