"""Procedurally generated Python repositories for the coding-agent task (`task.name = 'repo'`).

A repository has three modules of one small function each (`return a + b`, `a - b`, `a * b`,
the operator named by the function: `add`, `diff`, `scale`...) and a visible check script
`check.py` (one call per function). One function is broken: a wrong operator ("bug") or a body
that raises NotImplementedError ("missing"). The prompt names the module, the function and one
call's wanted value:

    Fix geo.py: add(4, 2) should be 6\\n

The hidden tests (`HiddenTest`) are calls with their expected values: four of the broken
function (fail to pass) and one of every other function (pass to pass, so that breaking other
code costs reward). They live only in the task record on the host: never in the session's
file system, never in the grading sandbox's candidate process (envs/repo/environment.py).

Guaranteed: deterministic in (seed, split); train and eval are disjoint (split by the parity of a
hash of the broken function's signature: module, name, arguments, operator, kind); the
reference fix passes every hidden test and the broken repository fails every fail-to-pass one
(the arguments are chosen so that +, - and * always give three different values; a test
checks both with the real grader). Not guaranteed: that a task needs reading to be solved by a
model that memorised the generator (the wrong operator is drawn at random, so a patch written
without reading the file is usually wrong, which is what the teacher's mistakes exploit).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Literal, Sequence

OPERATORS = ("+", "-", "*")
NAMES = {
    "+": ("add", "plus", "total", "join"),
    "-": ("sub", "minus", "diff", "drop"),
    "*": ("mul", "times", "scale", "area"),
}
ARGUMENTS = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"), ("u", "v"), ("s", "t"))
MODULES = ("geo", "calc", "money", "stats", "units", "shapes", "clock", "grid", "bank", "score")
MISSING_BODY = "    raise NotImplementedError"
CHECK_FILE = "check.py"


@dataclass(frozen=True)
class Function:
    name: str
    arguments: tuple[str, str]
    operator: str

    def line(self, operator: str | None = None) -> str:
        a, b = self.arguments
        return f"    return {a} {operator or self.operator} {b}"

    def value(self, a: int, b: int) -> int:
        return {"+": a + b, "-": a - b, "*": a * b}[self.operator]


@dataclass(frozen=True)
class HiddenTest:
    module: str
    function: str
    args: tuple[int, int]
    expected: int


@dataclass(frozen=True)
class RepoTask:
    uid: str
    prompt: str
    files: dict[str, str]  # the repository as the episode starts: path -> text
    path: str  # the broken module
    broken_line: str  # its line to replace
    fixed_line: str  # the reference fix of that line
    function: Function  # the broken function (its correct form)
    kind: Literal["bug", "missing"]
    hidden: tuple[HiddenTest, ...]
    visible: tuple[HiddenTest, ...]  # the calls check.py makes (one per function)

    @property
    def fixed_files(self) -> dict[str, str]:
        """The repository after the reference fix."""
        return {**self.files, self.path: self.files[self.path].replace(self.broken_line, self.fixed_line, 1)}


def module_source(functions: list[Function], broken: Function | None = None, broken_line: str = "") -> str:
    blocks = []
    for f in functions:
        body = broken_line if f is broken else f.line()
        blocks.append(f"def {f.name}({', '.join(f.arguments)}):\n{body}\n")
    return "\n\n".join(blocks)


def check_source(visible: list[HiddenTest]) -> str:
    """The visible check: one call per function; prints `ok` or what failed."""
    cases = ",\n    ".join(f"({t.module!r}, {t.function!r}, {t.args!r}, {t.expected})" for t in visible)
    return (
        f"import importlib\n\nCASES = [\n    {cases},\n]\nbad = []\n"
        "for module, name, args, want in CASES:\n"
        "    try:\n        got = getattr(importlib.import_module(module), name)(*args)\n"
        "    except Exception as error:\n        got = type(error).__name__\n"
        '    if got != want:\n        bad.append(f"{name}{args} = {got}, want {want}")\n'
        'print("FAIL " + "; ".join(bad) if bad else "ok")\n'
    )


def check_verdict(files: dict[str, str], visible: Sequence[HiddenTest]) -> str:
    """What check.py prints over `files` (computed on the host from the generator's own code, so
    the teacher's transcripts show exactly what the `test` tool would)."""
    scopes: dict[str, dict] = {}
    for path, text in files.items():
        if path.endswith(".py") and path != CHECK_FILE:
            scopes[path[:-3]] = scope = {}
            exec(compile(text, path, "exec"), scope)  # trusted: generated here, never the model's
    bad = []
    for t in visible:
        try:
            got = scopes[t.module][t.function](*t.args)
        except Exception as error:  # noqa: BLE001 -- the missing body's NotImplementedError
            got = type(error).__name__
        if got != t.expected:
            bad.append(f"{t.function}{t.args} = {got}, want {t.expected}")
    return "FAIL " + "; ".join(bad) + "\n" if bad else "ok\n"


def _arguments(rng: random.Random) -> tuple[int, int]:
    """Two numbers for which +, - and * give three different values (a != b, not both 2)."""
    while True:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        if a != b:
            return a, b


def _split_of(signature: str) -> str:
    return "train" if zlib.crc32(signature.encode()) % 2 == 0 else "eval"


def generate_repo_tasks(seed: int, split: str, count: int, missing_frac: float = 0.3) -> list[RepoTask]:
    """`count` distinct repositories of `split` ('train' or 'eval')."""
    rng = random.Random(f"{seed}-repo-{split}")
    tasks: list[RepoTask] = []
    seen: set[str] = set()
    while len(tasks) < count:
        task = _one_task(rng, missing_frac, f"repo-{split}-{len(tasks)}")
        key = task.prompt + "".join(task.files.values())
        if key in seen:
            continue
        signature = f"{task.path}|{task.function}|{task.kind}|{task.broken_line}"
        if _split_of(signature) != split:
            continue
        seen.add(key)
        tasks.append(task)
    return tasks


def _one_task(rng: random.Random, missing_frac: float, uid: str) -> RepoTask:
    module_names = rng.sample(MODULES, 3)
    used: set[str] = set()
    functions: list[Function] = []
    for _ in module_names:
        op = rng.choice(OPERATORS)
        name = rng.choice([n for n in NAMES[op] if n not in used])
        used.add(name)
        functions.append(Function(name, rng.choice(ARGUMENTS), op))
    modules = {m: [f] for m, f in zip(module_names, functions)}
    target_index = rng.randrange(3)
    target, module = functions[target_index], module_names[target_index]
    kind: Literal["bug", "missing"] = "missing" if rng.random() < missing_frac else "bug"
    wrong = [o for o in OPERATORS if o != target.operator]
    broken_line = MISSING_BODY if kind == "missing" else target.line(rng.choice(wrong))  # no draw for a missing body
    calls = {f.name: _arguments(rng) for f in functions}
    visible = tuple(
        HiddenTest(m, f.name, calls[f.name], f.value(*calls[f.name])) for m, fs in modules.items() for f in fs
    )
    files = {f"{m}.py": module_source(fs, target if m == module else None, broken_line) for m, fs in modules.items()}
    files[CHECK_FILE] = check_source(list(visible))
    hidden = []
    for m, fs in modules.items():
        for f in fs:
            drawn: set[tuple[int, int]] = set()
            while len(drawn) < (4 if f is target else 1):
                args = _arguments(rng)
                if args not in drawn:
                    drawn.add(args)
                    hidden.append(HiddenTest(m, f.name, args, f.value(*args)))
    a, b = calls[target.name]
    prompt = f"Fix {module}.py: {target.name}({a}, {b}) should be {target.value(a, b)}\n"
    return RepoTask(
        uid, prompt, files, f"{module}.py", broken_line, target.line(), target, kind, tuple(hidden), visible
    )
