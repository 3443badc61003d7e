"""Math environment: the completion's final answer, checked against the reference by math-verify.

reward 1.0 for an equivalent answer, else 0.0: math-verify's own `parse` on the completion and
`verify` against the boxed reference, plus, if asked, gapless's additions where math-verify reads
nothing (`lenient`, config `task.math_lenient`); statuses as in `envs/math/answer.py` (ok,
wrong_answer, no_answer, parse_error, timeout; infra_error only if the off-main-thread helper
process cannot grade a trusted probe: a helper that an answer kills is that answer's parse_error). Tasks come from the procedural arithmetic generator (`ProceduralMathEnvironment`,
which also has a deliberately imperfect teacher for the warm start) or from a data file of
records {prompt, answer[, uid, split]} (`load_math_dataset`; JSONL or Parquet, a malformed
record stops loading with file and line). Identical completions of a task are graded once.
Not guaranteed: that grading is fast for hostile answers (each check is bounded by `timeout_s`,
so a step full of them is slow, not stuck).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

from gapless.envs.base import Split
from gapless.envs.math.answer import MATH_VERIFY_TIMEOUT_S, grade
from gapless.envs.math.problems import MathTask
from gapless.envs.records import load_records, require_str, split_by_hash, stable_uid
from gapless.types import Completion, Rollout


class MathEnvironment:
    def __init__(
        self,
        splits: dict[str, Sequence[MathTask]],
        name: str = "math",
        timeout_s: int = MATH_VERIFY_TIMEOUT_S,
        lenient: bool = False,
    ):
        self.splits = dict(splits)
        self.name = name
        self.timeout_s = timeout_s
        self.lenient = lenient

    def tasks(self, split: Split) -> Sequence[MathTask]:
        return self.splits.get(split, [])

    def score_groups(self, tasks: Sequence[MathTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        out = []
        for task, completions in zip(tasks, groups):
            graded: dict[str, tuple[float, str]] = {}
            rollouts = []
            for c in completions:
                if c.text not in graded:
                    graded[c.text] = grade(
                        task.answer, c.text, task.answer_follows_prompt, self.timeout_s, self.lenient
                    )
                reward, status = graded[c.text]
                rollouts.append(Rollout(task.uid, c, reward, status, {"reference": task.answer}))
            out.append(rollouts)
        return out

    def close(self) -> None:
        pass


class ProceduralMathEnvironment(MathEnvironment):
    """The procedural arithmetic task with its left-to-right teacher (envs/math/problems.py)."""

    def __init__(
        self,
        splits: dict[str, Sequence[MathTask]],
        teacher_error_frac: float,
        timeout_s: int = MATH_VERIFY_TIMEOUT_S,
        lenient: bool = False,
    ):
        super().__init__(splits, "math", timeout_s, lenient)
        self.teacher_error_frac = teacher_error_frac

    def reference(self, task: MathTask) -> str:
        return task.answer

    def demonstration(self, task: MathTask, rng: random.Random) -> str:
        wrong = rng.random() < self.teacher_error_frac
        return task.mistake if wrong and task.mistake is not None else task.answer


def parse_math_record(record: dict) -> MathTask:
    prompt = require_str(record, "prompt")
    answer = record["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        raise ValueError(f"field 'answer' must be a non-empty string or a number, got {answer!r}")
    uid = str(record.get("uid") or stable_uid(prompt))
    split = record.get("split") or split_by_hash(uid)
    if split not in ("train", "eval"):
        raise ValueError(f"field 'split' must be 'train' or 'eval', got {split!r}")
    return MathTask(uid, prompt, str(answer), split=split)


def load_math_dataset(path: str | Path) -> dict[str, list[MathTask]]:
    tasks = load_records(path, parse_math_record)
    return {split: [t for t in tasks if t.split == split] for split in ("train", "eval")}
