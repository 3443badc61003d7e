"""Procedurally generated code-synthesis problems with hidden unit tests (the embedded task).

A problem shows a few input/output examples of an unknown function `f` and the start of its
definition, ending at `return`; the model completes the `return` expression, starting with the
space after `return` (` x + 3`). The prompt ends at a word so that the completion starts where
a pre-tokenizer that attaches spaces to the following word (Qwen2's, the embedded tokenizer's)
starts one: prompt and completion encoded apart give the tokens of the whole program, so the
model never has to continue from a bare space. Hidden tests call `f` on other inputs.
Three levels: 1 = one operation (`x + 3`, `s.upper()`, `max(xs)`), 2 = an operation with a
parameter or two (`x * 4 + 1`, `s[:2]`, `[v + 3 for v in xs]`), 3 = compositions
(`s[::-1].upper()`, `sorted(xs)[:2]`, `(x + 2) * 3`).

Visible examples use non-negative numbers and lower-case strings; hidden tests also use negative
numbers and upper-case letters. `overfit_solution` is what a solver that checks only the visible
examples may write (the input normalised as they look, e.g. `abs(x) + 3`): right on every visible
example, wrong on hidden edge cases. The warm start mixes such demonstrations in (see
`trainer/warmstart/pairs.py`), so RL has a realistic habit to unlearn.

Guarantees: generation is deterministic in (seed, split, index); the 'train' and 'eval' splits
are disjoint by prompt text (a problem's split is decided by a hash of its prompt); expected
outputs come from evaluating the reference expression here, on trusted code we generated.
Not guaranteed: that the visible examples pin down a unique function (a few problems are
ambiguous, which caps the reachable pass rate slightly below 1).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

Split = str  # "train" | "eval"

# Each family: (level, argument kind, template with {a}/{b} parameters, parameter sampler).
_Sampler = Callable[[random.Random], dict[str, int]]


def _no_params(rng: random.Random) -> dict[str, int]:
    return {}


def _k(lo: int, hi: int) -> _Sampler:
    return lambda rng: {"a": rng.randint(lo, hi)}


def _ab(lo_a: int, hi_a: int, lo_b: int, hi_b: int) -> _Sampler:
    return lambda rng: {"a": rng.randint(lo_a, hi_a), "b": rng.randint(lo_b, hi_b)}


FAMILIES: list[tuple[int, str, str, _Sampler]] = [
    # level 1: one operation
    (1, "int", "x + {a}", _k(1, 9)),
    (1, "int", "x * {a}", _k(2, 9)),
    (1, "int", "x - {a}", _k(1, 9)),
    (1, "int", "x * x", _no_params),
    (1, "str", "s.upper()", _no_params),
    (1, "str", "s[::-1]", _no_params),
    (1, "str", "s + s", _no_params),
    (1, "str", "len(s)", _no_params),
    (1, "list", "sum(xs)", _no_params),
    (1, "list", "max(xs)", _no_params),
    (1, "list", "min(xs)", _no_params),
    (1, "list", "sorted(xs)", _no_params),
    # level 2: parameters
    (2, "int", "x * {a} + {b}", _ab(2, 9, 1, 9)),
    (2, "int", "x % {a}", _k(2, 9)),
    (2, "int", "x // {a}", _k(2, 9)),
    (2, "str", "s[:{a}]", _k(1, 3)),
    (2, "str", "s * {a}", _k(2, 3)),
    (2, "list", "[v + {a} for v in xs]", _k(1, 9)),
    (2, "list", "[v * {a} for v in xs]", _k(2, 9)),
    (2, "list", "sum(xs) + {a}", _k(1, 9)),
    # level 3: compositions
    (3, "int", "x * x + {a}", _k(1, 9)),
    (3, "int", "(x + {a}) * {b}", _ab(1, 9, 2, 9)),
    (3, "str", "s[::-1].upper()", _no_params),
    (3, "str", "(s + s).upper()", _no_params),
    (3, "list", "sorted(xs)[::-1]", _no_params),
    (3, "list", "sorted(xs)[:{a}]", _k(1, 3)),
    (3, "list", "[v * {a} + {b} for v in xs]", _ab(2, 5, 1, 9)),
]

_ARG_NAME = {"int": "x", "str": "s", "list": "xs"}
# How a solver that only checks the visible examples (non-negative, lower case) may normalise
# the input: harmless on those examples, wrong on the hidden edge cases.
_NORMALISED = {"int": "abs(x)", "str": "s.lower()", "list": "[abs(v) for v in xs]"}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class CodeProblem:
    """One prompt of the code task: what the model sees plus its hidden tests."""

    uid: str
    level: int
    prompt: str
    solution: str  # reference completion: the `return` expression after its space (" x + 3")
    overfit_solution: str  # agrees with `solution` on the visible examples, not on edge cases
    entry_point: str
    test_inputs: tuple[str, ...]  # JSON-encoded argument lists, one per hidden test
    test_outputs: tuple[str, ...]  # canonical JSON of the expected result
    harness: str = "io"  # how the sandbox runs the tests (envs/code/environment.py)

    def program(self, completion: str) -> str:
        """The Python source the sandbox runs for `completion` (prompt code + completion)."""
        code_start = self.prompt.index("def ")
        return self.prompt[code_start:] + completion + "\n"


def _sample_input(kind: str, rng: random.Random, wide: bool) -> Any:
    """Visible inputs are narrow (non-negative, lower case); hidden tests also probe the edge
    cases the visible examples never show (negative numbers, upper-case letters)."""
    if kind == "int":
        return rng.randint(-9 if wide else 0, 12)
    if kind == "str":
        letters = _LETTERS[:8] + (_LETTERS[:8].upper() if wide else "")
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 4)))
    return [rng.randint(-9 if wide else 0, 9) for _ in range(rng.randint(2, 4))]


def _anchor_inputs(kind: str, rng: random.Random) -> list[Any]:
    """Visible inputs that make parameters readable: f(0) shows an offset, f(1) a factor."""
    if kind == "int":
        return [0, 1]
    if kind == "list":
        return [
            [0] + [rng.randint(0, 9) for _ in range(rng.randint(1, 3))],
            [1] + [rng.randint(0, 9) for _ in range(rng.randint(1, 3))],
        ]
    return []


def _distinct_inputs(kind: str, rng: random.Random, num_visible: int, num_hidden: int) -> list[Any]:
    seen: list[Any] = _anchor_inputs(kind, rng)
    while len(seen) < num_visible + num_hidden:
        value = _sample_input(kind, rng, wide=len(seen) >= num_visible)
        if value not in seen:
            seen.append(value)
    return seen


def canonical(value: Any) -> str:
    """Canonical JSON used to compare results: `1`, `true` and `1.0` all differ."""
    return json.dumps(value, sort_keys=True)


def make_problem(rng: random.Random, levels: list[int], num_visible: int = 3, num_hidden: int = 5) -> CodeProblem:
    candidates = [fam for fam in FAMILIES if fam[0] in levels]
    level, kind, template, sampler = rng.choice(candidates)
    solution = template.format(**sampler(rng))
    arg = _ARG_NAME[kind]
    fn = eval(f"lambda {arg}: {solution}")  # our own reference expression, trusted
    inputs = _distinct_inputs(kind, rng, num_visible, num_hidden)
    visible, hidden = inputs[:num_visible], inputs[num_visible:]
    shown = "; ".join(f"f({v!r}) -> {fn(v)!r}" for v in visible)
    prompt = f"# {shown}\ndef f({arg}):\n    return"
    uid = hashlib.sha256(prompt.encode()).hexdigest()[:16]
    return CodeProblem(
        uid=uid,
        level=level,
        prompt=prompt,
        solution=" " + solution,
        overfit_solution=" " + re.sub(rf"\b{arg}\b", _NORMALISED[kind], solution),
        entry_point="f",
        test_inputs=tuple(json.dumps([v]) for v in hidden),
        test_outputs=tuple(canonical(fn(v)) for v in hidden),
    )


def split_of(problem: CodeProblem) -> Split:
    """Deterministic split by prompt hash: about 1 in 8 prompts is held out for evaluation."""
    return "eval" if int(problem.uid, 16) % 8 == 0 else "train"


def generate_problems(seed: int, split: Split, count: int, levels: list[int], num_hidden: int = 5) -> list[CodeProblem]:
    """`count` distinct problems of `split`, deterministic in (seed, split, levels)."""
    rng = random.Random(f"gapless-code-{seed}-{split}-{sorted(levels)}")
    out: dict[str, CodeProblem] = {}
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 200 * count + 10_000:
            raise ValueError(f"could not generate {count} distinct {split} problems for levels {levels}; ask for fewer")
        problem = make_problem(rng, levels, num_hidden=num_hidden)
        if split_of(problem) == split and problem.uid not in out:
            out[problem.uid] = problem
    return list(out.values())
