"""An instance's texts: the failing tests taken out of the agent's copy, the diffs, the problem statement.

`hide_tests(files, test_ids)` removes the test functions (with their decorators; a method of a
class, or a function at module level) that the ids name, and returns the changed test files, or
None when a test cannot be found that way (generated or inherited tests): the build then drops
the mutation. A parametrised test goes whole, so its passing siblings are hidden too (they are
back when `test_patch` is applied). `unified_diff` writes a git-style diff that `git apply` and
`patch -p1` take. `problem_statement` is what the agent is told: the failing tests' names and
the end of their failure texts (assertion messages, trimmed traceback).
"""

from __future__ import annotations

import ast
import difflib
import re
from typing import Mapping, Sequence

MAX_TESTS_SHOWN = 3
MAX_TRACE_LINES = 14
MAX_LINE_CHARS = 160
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def hide_tests(files: Mapping[str, bytes], test_ids: Sequence[str]) -> dict[str, bytes] | None:
    """{test file: its text without the named tests}, or None if one cannot be found."""
    wanted: dict[str, set[tuple[str, ...]]] = {}
    for test_id in test_ids:
        path, _, rest = test_id.partition("::")
        parts = rest.split("::")
        parts[-1] = parts[-1].split("[", 1)[0]
        wanted.setdefault(path, set()).add(tuple(parts))
    hidden = {}
    for path, names in sorted(wanted.items()):
        if path not in files:
            return None
        text = _without(files[path], names)
        if text is None:
            return None
        hidden[path] = text
    return hidden


def _without(source: bytes, names: set[tuple[str, ...]]) -> bytes | None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines = source.splitlines(keepends=True)
    spans: list[tuple[int, int, str]] = []  # first line (0-based), end line (exclusive), replacement
    for name in names:
        node = _find(tree.body, name)
        if node is None:
            return None
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())].decode("utf-8", "replace")
        spans.append((first, node.end_lineno, f"{indent}pass\n" if len(name) > 1 else ""))  # a class keeps a body
    for first, end, replacement in sorted(set(spans), reverse=True):
        lines[first:end] = [replacement.encode()] if replacement else []
    return b"".join(lines)


def _find(body: list[ast.stmt], name: tuple[str, ...]) -> ast.AST | None:
    for node in body:
        if getattr(node, "name", None) != name[0]:
            continue
        if len(name) == 1 and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
        if len(name) > 1 and isinstance(node, ast.ClassDef):
            return _find(node.body, name[1:])
    return None


def unified_diff(path: str, old: bytes, new: bytes) -> str:
    """The change old -> new of one file, as `diff --git` writes it ('' when equal)."""
    if old == new:
        return ""
    a = old.decode("utf-8", "surrogateescape").splitlines(keepends=True)
    b = new.decode("utf-8", "surrogateescape").splitlines(keepends=True)
    out = [f"diff --git a/{path} b/{path}\n"]
    for line in difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=3):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def problem_statement(package: str, failing: Sequence[str], messages: Mapping[str, str]) -> str:
    """What the agent is told about a bug: the failing tests and how they fail."""
    count = len(failing)
    lines = [
        f"After a recent change to `{package}`, {count} test{'s' if count != 1 else ''} of its own suite "
        f"fail{'' if count != 1 else 's'}. The tests are right; the package's code is wrong.",
        "",
    ]
    for test_id in failing[:MAX_TESTS_SHOWN]:
        lines += [f"Failing: `{test_id}`", "```", *_trimmed(messages.get(test_id, "")), "```", ""]
    if count > MAX_TESTS_SHOWN:
        lines += [f"... and {count - MAX_TESTS_SHOWN} more: " + ", ".join(f"`{t}`" for t in failing[MAX_TESTS_SHOWN:10])
                  + (", ..." if count > 10 else ""), ""]  # fmt: skip
    lines.append(
        "Fix the package's source so that these tests pass and the rest of the suite still passes. The failing "
        "tests are not in your copy of the repository; they are run when your fix is graded."
    )
    return "\n".join(lines)


def _trimmed(message: str) -> list[str]:
    message = _ADDRESS.sub("0x...", message)  # object addresses differ between runs: the text must not
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    lines = lines[-MAX_TRACE_LINES:] or ["(no failure text)"]
    return [line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "..." for line in lines]
