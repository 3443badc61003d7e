"""A new environment in under 50 lines: reverse a short word (docs/environments.md).

Run a few RL steps on it: `PYTHONPATH=src python examples/reverse_env.py`.
"""

import hashlib
import random
from dataclasses import dataclass

from gapless.types import Rollout


@dataclass(frozen=True)
class WordTask:  # a Task: uid and prompt, plus what scoring needs
    uid: str
    prompt: str
    word: str


class ReverseEnvironment:
    name = "reverse"

    def __init__(self, seed: int = 0, count: int = 300):
        rng = random.Random(seed)
        words = sorted({"".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4))) for _ in range(count)})
        tasks = [WordTask(hashlib.sha256(w.encode()).hexdigest()[:16], f"Reverse {w}.\nAnswer: ", w) for w in words]
        self.splits = {"train": [], "eval": []}
        for t in tasks:  # 1 in 8 held out, by a hash of the word
            self.splits["eval" if int(t.uid, 16) % 8 == 0 else "train"].append(t)

    def tasks(self, split):
        return self.splits[split]

    def score_groups(self, tasks, groups):
        return [[Rollout(t.uid, c, *self.grade(t, c.text)) for c in cs] for t, cs in zip(tasks, groups)]

    def grade(self, task, text):  # untrusted text in, (reward, status) out: never raises
        lines = text.strip().splitlines()
        if not lines:
            return 0.0, "no_answer"
        return (1.0, "ok") if lines[0].strip() == task.word[::-1] else (0.0, "wrong_answer")

    def close(self):
        pass

    # Optional (envs.base.Teacher): lets the warm start teach a fresh model the format.
    def reference(self, task):
        return task.word[::-1]

    def demonstration(self, task, rng):  # an imperfect teacher: copies the word 40% of the time
        return task.word if rng.random() < 0.4 else task.word[::-1]


if __name__ == "__main__":
    from gapless.config import load_config
    from gapless.orchestrate.loop import RunLoop

    cfg = load_config("configs/smoke.toml", {"run_dir": '"runs/reverse"', "loop.steps": "5"})
    print(RunLoop(cfg, env=ReverseEnvironment()).run())
