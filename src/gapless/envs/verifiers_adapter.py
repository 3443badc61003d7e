"""Prime Intellect `verifiers` (v1 API, >= 0.4) tasks as a gapless environment: single-turn only.

A verifiers `Task` carries its data (`TaskData.prompt`) and its scoring (`@vf.reward` methods and
plugged judges, all async). This adapter takes tasks (any iterable, e.g. a `vf.Taskset`), shows
the model `prompt_text` (system prompt first, when there is one), and scores a completion by
building a `Trace` whose `root_reply` is the completion and awaiting `task.score(trace)` with no
runtime; the reward is the trace's weighted reward. Status: ok (reward >= 1), partial (0 < r < 1),
wrong_answer (0), score_error (scoring raised or recorded an error: reward 0, counted, not raised).
What works: tasks whose rewards read `trace.last_reply` (or the task data) and need no runtime.
What does not: rewards that read `trace.messages` (no message graph is built), rewards or judges
that need a runtime (verifiers skips them without one: they are silently absent from the reward),
LLM judges (they need an OpenAI-compatible client; use gapless's own judge environment), tool
use and multi-turn episodes (verifiers drives those through its own harness and client).
Not guaranteed: stability across verifiers releases (the Trace model is constructed directly).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from gapless.envs.base import Split
from gapless.envs.records import split_by_hash
from gapless.types import Completion, Rollout


@dataclass(frozen=True)
class VerifiersTask:
    uid: str
    prompt: str
    task: Any  # the verifiers Task


class VerifiersEnvironment:
    """`train`/`eval`: verifiers tasks; with `eval=None`, 1 in 8 train tasks is held out by hash."""

    def __init__(self, train: Iterable[Any], eval: Iterable[Any] | None = None, name: str = "verifiers"):
        self.name = name
        wrapped = [self._wrap(t) for t in train]
        if eval is None:
            self.splits = {s: [t for t in wrapped if split_by_hash(t.uid) == s] for s in ("train", "eval")}
        else:
            self.splits = {"train": wrapped, "eval": [self._wrap(t) for t in eval]}

    @staticmethod
    def _wrap(task: Any) -> VerifiersTask:
        data = task.data
        prompt = data.prompt_text if data.system_prompt is None else f"{data.system_prompt}\n\n{data.prompt_text}"
        return VerifiersTask(task.key, prompt, task)

    def tasks(self, split: Split) -> Sequence[VerifiersTask]:
        return self.splits.get(split, [])

    def score(self, task: VerifiersTask, text: str) -> tuple[float, str, dict]:
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        trace = Trace(task=TraceTask(type=type(task.task).__name__, data=task.task.data),
                      agent=AgentInfo(config=AgentConfig()), root_reply=text)
        try:
            asyncio.run(task.task.score(trace))
            reward = float(trace.reward)
        except Exception as exc:  # noqa: BLE001 -- a scorer failing on model output is a status
            return 0.0, "score_error", {"error": f"{type(exc).__name__}: {exc}"[:300]}
        if trace.errors or not math.isfinite(reward):
            return 0.0, "score_error", {"error": str(trace.errors[-1])[:300] if trace.errors else "non-finite reward"}
        info = {name: r.score for name, r in trace.rewards.items() if r is not None}
        status = "ok" if reward >= 1.0 else "partial" if reward > 0 else "wrong_answer"
        return reward, status, info

    def score_groups(self, tasks: Sequence[VerifiersTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        out = []
        for task, completions in zip(tasks, groups):
            graded: dict[str, tuple[float, str, dict]] = {}
            for c in completions:
                if c.text not in graded:
                    graded[c.text] = self.score(task, c.text)
            out.append([Rollout(task.uid, c, *graded[c.text]) for c in completions])
        return out

    def close(self) -> None:
        pass
