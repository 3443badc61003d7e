"""Procedural arithmetic problems for the math environment, sized for a ~1M-parameter model.

A prompt asks for the value of a short expression over single digits and ends with "Answer: ":
    level 1   a + b, a - b                  "Compute 3+4.\\nAnswer: "  -> "7"
    level 2   a * b, a + b + c, a - b + c
    level 3   a + b * c, a - b * c, a * (b + c), (a + b) * c, a * b - c   (precedence matters)
The teacher used by the warm start has one habit: it evaluates strictly left to right, ignoring
precedence and parentheses (`mistake`). That is right for levels 1-2 and for some level-3 forms,
wrong for others (3+4*2 -> 14): the warm-started model learns both answers and RL against the
verifier has to find out which one is rewarded.
Guarantees: deterministic in (seed, split, levels); splits disjoint by a hash of the prompt (1 in
8 held out); answers computed here by Python on integers (exact).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

FORMS: dict[int, list[str]] = {
    1: ["{a}+{b}", "{a}-{b}"],
    2: ["{a}*{b}", "{a}+{b}+{c}", "{a}-{b}+{c}"],
    3: ["{a}+{b}*{c}", "{a}-{b}*{c}", "{a}*({b}+{c})", "({a}+{b})*{c}", "{a}*{b}-{c}"],
}


@dataclass(frozen=True)
class MathTask:
    uid: str
    prompt: str
    answer: str  # the reference final answer (what math-verify compares against)
    level: int = 0
    mistake: str | None = None  # the left-to-right teacher's answer, when it has one
    split: str = "train"

    @property
    def answer_follows_prompt(self) -> bool:
        """The prompt ends with "Answer:", so a bare completion is the answer."""
        return self.prompt.rstrip().endswith("Answer:")


def left_to_right(expression: str) -> int:
    """The teacher's habit: drop parentheses, apply operators in reading order."""
    tokens = re.findall(r"\d+|[-+*]", expression.replace("(", "").replace(")", ""))
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = value + int(operand) if op == "+" else value - int(operand) if op == "-" else value * int(operand)
    return value


def make_math_problem(rng: random.Random, levels: list[int]) -> MathTask:
    level = rng.choice(levels)
    expression = rng.choice(FORMS[level]).format(a=rng.randint(0, 9), b=rng.randint(0, 9), c=rng.randint(0, 9))
    prompt = f"Compute {expression}.\nAnswer: "
    uid = hashlib.sha256(prompt.encode()).hexdigest()[:16]
    split = "eval" if int(uid, 16) % 8 == 0 else "train"
    answer = eval(expression)  # our own digits and operators: trusted
    return MathTask(uid, prompt, str(answer), level, str(left_to_right(expression)), split)


def generate_math_problems(seed: int, split: str, count: int, levels: list[int]) -> list[MathTask]:
    """Up to `count` distinct problems of `split`; fewer only if the levels have fewer (level 1 has 200)."""
    rng = random.Random(f"gapless-math-{seed}-{split}-{sorted(levels)}")
    out: dict[str, MathTask] = {}
    for _ in range(200 * count + 10_000):
        if len(out) == count:
            break
        task = make_math_problem(rng, levels)
        if task.split == split:
            out.setdefault(task.uid, task)
    return list(out.values())
