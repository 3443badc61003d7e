"""The embedded tool-use task: arithmetic a tiny model cannot do in its head, but can look up.

A prompt asks for the value of an expression such as `37*48+5`. The intended transcript:

    Q: 37*48+5\\n                    prompt
    <py>37*48+5</py><eos>             model turn 1: a tool call
    <out>1781</out>\\n                 environment: the tool's output (masked from the loss)
    Answer: 1781<eos>                 model turn 2: the final answer

so the model has to learn to copy the expression into a call, then copy the result out: easy
for a ~1M-parameter model, while computing 2-digit products itself is not. Turns end at EOS
(the end-of-turn token); the environment parses each model turn with `parse_turn`.

Demonstrations for the warm start come from an imperfect teacher: with `skip_frac` it answers
without the tool, from a mental estimate (the value rounded to hundreds: always wrong, and the
same for a task every time, so it cannot average out to the right answer), with `typo_frac` it
mistypes one operand in its call and faithfully reports the wrong result. RL has to learn to always call the tool and
copy exactly. Tasks and demonstrations are deterministic in the seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

ANSWER = "Answer:"
CALL_OPEN, CALL_CLOSE = "<py>", "</py>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<out>", "</out>"
MARKUP = (CALL_OPEN, CALL_CLOSE, OUTPUT_OPEN, OUTPUT_CLOSE)  # one token each in the embedded tokenizer


@dataclass(frozen=True)
class ToolTask:
    uid: str
    prompt: str
    expression: str
    answer: str  # str(value of the expression)

    @property
    def solution(self) -> str:
        """The ideal transcript as plain text (what a tokenizer for this task is trained on)."""
        return "".join(text for text, _ in ideal_transcript(self))


def generate_tool_tasks(seed: int, split: str, count: int) -> list[ToolTask]:
    """`count` distinct tasks; train and eval draw from disjoint halves of the expression space."""
    rng = random.Random(f"{seed}-tools-{split}")
    want_parity = 0 if split == "train" else 1  # the parity of the first operand splits the space
    tasks, seen = [], set()
    while len(tasks) < count:
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 99)
        if a % 2 != want_parity:
            continue
        expression = rng.choice([f"{a}*{b}", f"{a}*{b}+{c}", f"{a}*{b}-{c}"])
        if expression in seen:
            continue
        seen.add(expression)
        tasks.append(ToolTask(f"tool-{split}-{len(tasks)}", f"Q: {expression}\n", expression, str(eval(expression))))
    return tasks


def tool_output_text(output: str) -> str:
    """What the environment appends after a tool call."""
    return f"{OUTPUT_OPEN}{output}{OUTPUT_CLOSE}\n"


Segment = tuple[str, bool]  # (text, written by the model); a model segment ends its turn (EOS)


def ideal_transcript(task: ToolTask) -> list[Segment]:
    return [
        (f"{CALL_OPEN}{task.expression}{CALL_CLOSE}", True),
        (tool_output_text(task.answer), False),
        (f"{ANSWER} {task.answer}", True),
    ]


def demonstration(task: ToolTask, rng: random.Random, skip_frac: float, typo_frac: float) -> list[Segment]:
    """One transcript after the prompt, from the imperfect teacher."""
    draw = rng.random()
    if draw < skip_frac:
        return [(f"{ANSWER} {_estimate(task.answer)}", True)]
    expression = _mistyped(task.expression, rng) if draw < skip_frac + typo_frac else task.expression
    result = str(eval(expression))
    return [
        (f"{CALL_OPEN}{expression}{CALL_CLOSE}", True),
        (tool_output_text(result), False),
        (f"{ANSWER} {result}", True),
    ]


def _estimate(answer: str) -> str:
    value = int(answer)
    rounded = round(value, -2)
    return str(rounded if rounded != value else value + 100)


def _near_miss(answer: str, rng: random.Random) -> str:
    digits = list(answer)
    i = rng.randrange(len(digits) - 1 if digits[0] == "-" else len(digits)) + (digits[0] == "-")
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")])
    return "".join(digits)


def _mistyped(expression: str, rng: random.Random) -> str:
    numbers = re.findall(r"\d+", expression)
    target = rng.choice(numbers)
    return expression.replace(target, _near_miss(target, rng), 1)


@dataclass(frozen=True)
class Turn:
    kind: Literal["call", "answer", "none"]
    content: str = ""  # the code of a call, the value of an answer
    detail: str = ""  # why a turn is "none" (for the rollout's record)


def parse_turn(text: str) -> Turn:
    """Read one model turn: a tool call or an answer, whichever comes first; else "none".
    Untrusted: any text is accepted and never raises."""
    call_at, answer_at = text.find(CALL_OPEN), text.find(ANSWER)
    if call_at >= 0 and (answer_at < 0 or call_at < answer_at):
        end = text.find(CALL_CLOSE, call_at)
        if end < 0:
            return Turn("none", detail="unclosed <py>")
        return Turn("call", text[call_at + len(CALL_OPEN) : end])
    if answer_at >= 0:
        value = text[answer_at + len(ANSWER) :].strip().split("\n", 1)[0].strip()
        return Turn("answer", value)
    return Turn("none", detail="neither a tool call nor an answer")
