"""reasoning-gym data sets as an environment: procedural questions, scored by the data set itself.

`reasoning_gym.create_dataset(name, size, seed)` generates the questions locally (no download);
the train split uses `seed`, the eval split another seed with every question also in train
removed. Scoring is reasoning-gym's own pipeline, step for step:
    prompt   the data set's answer-format instruction (`reasoning_gym.utils.SYSTEM_PROMPTS`,
             "default": think, then `<answer>answer here</answer>`), a newline, the question
    answer   `reasoning_gym.utils.extract_answer`: the last `<answer>...</answer>`, whole (a
             multi-line grid stays a grid), stripped of surrounding whitespace and nothing else
    reward   the data set's own `score_answer(answer, entry)`, a float in [0, 1]
so a reward is what the data set's authors would give that completion
(`tests/unit/test_reasoning_gym_env.py` checks it on generated cases). Status:
    ok            score 1
    partial       0 < score < 1 (some data sets give partial credit)
    wrong_answer  score 0
    no_answer     no closed `<answer>...</answer>` in the completion (reward 0, as the data set
                  scores a missing answer)
    score_error   `score_answer` raised or returned a non-number on this output (reward 0): a
                  data set bug that model output triggered, counted instead of raised
Deliberate differences from the peer: none in the reward; a score outside [0, 1] is clipped
(none of the data sets gives one) and a non-finite one is score_error.
Not guaranteed: a time bound on `score_answer` (reasoning-gym's scorers are plain Python; none we
use evaluates model text, but a data set that did could be slow on hostile output).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

from gapless.envs.base import Split
from gapless.types import Completion, Rollout

EVAL_SEED_OFFSET = 1_000_003
PROMPT_STYLE = "default"  # the key of reasoning_gym.utils.SYSTEM_PROMPTS its own evaluations use
_CLOSE_TAG = "</answer>"


@dataclass(frozen=True)
class GymTask:
    uid: str
    prompt: str
    entry: dict[str, Any]  # the data set's own record: question, answer, metadata


def gym_answer(completion: str) -> str | None:
    """reasoning-gym's own extraction (the last `<answer>...</answer>`), or None without one.
    Text after the last closing tag cannot hold a match, so it is not searched: the same result,
    without a quadratic scan over a hostile tail of unclosed tags."""
    from reasoning_gym.utils import extract_answer

    end = completion.rfind(_CLOSE_TAG)
    if end < 0:
        return None
    return extract_answer(completion[: end + len(_CLOSE_TAG)])


class ReasoningGymEnvironment:
    def __init__(self, dataset: str, seed: int, num_train: int, num_eval: int):
        try:
            import reasoning_gym
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError:
            raise RuntimeError("task.name = 'reasoning_gym' needs reasoning-gym: pip install 'gapless[envs]'") from None
        self.name = f"reasoning_gym/{dataset}"
        self.instruction = SYSTEM_PROMPTS[PROMPT_STYLE].rstrip()
        self.dataset = reasoning_gym.create_dataset(dataset, size=num_train, seed=seed)
        train = [self._task(dataset, e) for e in self.dataset]
        seen = {t.prompt for t in train}
        held_out = reasoning_gym.create_dataset(dataset, size=num_eval, seed=seed + EVAL_SEED_OFFSET)
        evalset = [t for t in (self._task(dataset, e) for e in held_out) if t.prompt not in seen]
        self.splits = {"train": train, "eval": evalset}

    def _task(self, dataset: str, entry: dict) -> GymTask:
        prompt = f"{self.instruction}\n{entry['question'].rstrip()}\n"
        return GymTask(hashlib.sha256(f"{dataset}\x00{prompt}".encode()).hexdigest()[:16], prompt, entry)

    def tasks(self, split: Split) -> Sequence[GymTask]:
        return self.splits.get(split, [])

    def score(self, task: GymTask, text: str) -> tuple[float, str]:
        answer = gym_answer(text)
        if answer is None:
            return 0.0, "no_answer"
        try:
            score = float(self.dataset.score_answer(answer, task.entry))
        except Exception:  # noqa: BLE001 -- a scorer crash on model output is a status, not a crash of the run
            return 0.0, "score_error"
        if not math.isfinite(score):
            return 0.0, "score_error"
        score = min(max(score, 0.0), 1.0)
        return score, "ok" if score == 1.0 else "partial" if score > 0 else "wrong_answer"

    def score_groups(self, tasks: Sequence[GymTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        out = []
        for task, completions in zip(tasks, groups):
            graded: dict[str, tuple[float, str]] = {}
            for c in completions:
                if c.text not in graded:
                    graded[c.text] = self.score(task, c.text)
            out.append(
                [
                    Rollout(task.uid, c, *graded[c.text], {"reference": str(task.entry.get("answer"))})
                    for c in completions
                ]
            )
        return out

    def close(self) -> None:
        pass
