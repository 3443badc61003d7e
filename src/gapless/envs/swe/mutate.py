"""Bug injection by AST mutation: every single-site change of one Python source file.

`mutations(path, source)` lists `Mutation`s; each replaces one byte span of the file's UTF-8
text, found from the AST's positions, so a mutant differs from the original only at that span
and its diff is the reverse patch a human would write. Kinds:

    operator          a + b -> a - b, a * b -> a / b, x += 1 -> x -= 1, & <-> |, << <-> >>
    comparison        < <-> <=, > <-> >=, == <-> !=, in <-> not in, is <-> is not
    boolean           and <-> or
    condition         `if c:` -> `if not (c):` (also while), `not c` -> `c`
    boundary          an integer constant n -> n + 1 and n - 1 (off-by-one)
    constant          True <-> False, a non-empty string -> ""
    remove_statement  an assignment, call or raise statement -> pass
    swap_arguments    f(a, b, ...) -> f(b, a, ...)
    early_return      the function's final `return NAME` also placed before the statement above it

Skipped: docstrings, annotations, f-string parts, `if __name__ == "__main__"` and `TYPE_CHECKING`
blocks, module-level dunder assignments (`__all__`, `__version__`). `ordered(...)` interleaves the
kinds in an order fixed by a seed, so a budget of tries covers every kind.

Guaranteed: every mutant differs from the original; `parses` says whether it is Python. NOT guaranteed: that it changes
behaviour (equivalent mutants exist; the build's tests decide).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

_BINOPS = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "/"),
    ast.Div: ("/", "*"),
    ast.FloorDiv: ("//", "/"),
    ast.Mod: ("%", "//"),
    ast.BitAnd: ("&", "|"),
    ast.BitOr: ("|", "&"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
}
_COMPARISONS = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
}
_BOOLEANS = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise, ast.Delete)
KINDS = ("operator", "comparison", "boolean", "condition", "boundary", "constant", "remove_statement",
         "swap_arguments", "early_return")  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    path: str  # the repository-relative source file
    kind: str
    line: int  # 1-based, where the change starts
    start: int  # byte offsets of the replaced span in the file's UTF-8 text
    end: int
    replacement: bytes
    description: str  # e.g. "`<` -> `<=`"

    def apply(self, original: bytes) -> bytes:
        return original[: self.start] + self.replacement + original[self.end :]

    @property
    def key(self) -> str:
        """Stable name of the change (file, span, new text): a cache key."""
        digest = hashlib.sha256(f"{self.path}:{self.start}:{self.end}:".encode() + self.replacement)
        return digest.hexdigest()[:16]


def mutations(path: str, source: bytes) -> list[Mutation]:
    """Every mutation of `source` ([] for a file that does not parse). Whether a mutant parses
    is checked by `parses`, when it is about to be tried: a whole-file parse per candidate
    costs more than the few that are tried."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [m for m in _Sites(path, source, tree).collect() if m.replacement != source[m.start : m.end]]


def parses(mutation: Mutation, source: bytes) -> bool:
    try:
        ast.parse(mutation.apply(source))
    except (SyntaxError, ValueError):
        return False
    return True


def ordered(candidates: Iterable[Mutation], seed: int | str) -> list[Mutation]:
    """The candidates in a seeded order that takes the kinds in turn (round-robin)."""
    rng = random.Random(f"swe-mutations:{seed}")
    by_kind: dict[str, list[Mutation]] = {}
    for mutation in sorted(candidates, key=lambda m: (m.path, m.start, m.end, m.replacement)):
        by_kind.setdefault(mutation.kind, []).append(mutation)
    queues = []
    for kind in sorted(by_kind):
        items = by_kind[kind]
        rng.shuffle(items)
        queues.append(items)
    rng.shuffle(queues)
    result: list[Mutation] = []
    while queues:
        for queue in list(queues):
            result.append(queue.pop())
            if not queue:
                queues.remove(queue)
    return result


class _Sites:
    def __init__(self, path: str, source: bytes, tree: ast.Module) -> None:
        self.path, self.source, self.tree = path, source, tree
        self.line_starts = [0]
        for index, byte in enumerate(source):
            if byte == 0x0A:
                self.line_starts.append(index + 1)
        self.skipped = _skipped_nodes(tree)

    def offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def text(self, node: ast.AST) -> bytes:
        start, end = self.span(node)
        return self.source[start:end]

    def make(self, kind: str, line: int, start: int, end: int, new: bytes, description: str) -> Mutation:
        return Mutation(self.path, kind, line, start, end, new, description)

    def collect(self) -> Iterator[Mutation]:
        for node in ast.walk(self.tree):
            if id(node) in self.skipped:
                continue
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                yield from self.between("operator", node.left, node.right, *_BINOPS[type(node.op)])
            elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOPS:
                old, new = _BINOPS[type(node.op)]
                yield from self.between("operator", node.target, node.value, old + "=", new + "=")
            elif isinstance(node, ast.Compare):
                for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
                    if type(op) in _COMPARISONS:
                        yield from self.between("comparison", left, right, *_COMPARISONS[type(op)])
            elif isinstance(node, ast.BoolOp):
                for left, right in zip(node.values, node.values[1:]):
                    yield from self.between("boolean", left, right, *_BOOLEANS[type(node.op)])
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                start, _ = self.span(node)
                operand_start, _ = self.span(node.operand)
                if _clean(self.source[start:operand_start].decode("utf-8", "replace")) == "not":
                    yield self.make("condition", node.lineno, start, operand_start, b"", "`not c` -> `c`")
            elif isinstance(node, ast.Constant):
                yield from self.constant(node)
            elif isinstance(node, ast.Call):
                yield from self.swap(node)
            if isinstance(node, (ast.If, ast.While)) and not isinstance(node.test, ast.UnaryOp):
                start, end = self.span(node.test)
                yield self.make("condition", node.test.lineno, start, end, b"not (" + self.text(node.test) + b")",
                                "condition negated")  # fmt: skip
            if isinstance(node, _REMOVABLE) and not _is_docstring_expr(node):
                start, end = self.span(node)
                yield self.make("remove_statement", node.lineno, start, end, b"pass", "statement removed")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from self.early_return(node)

    def between(self, kind: str, left: ast.AST, right: ast.AST, old: str, new: str) -> Iterator[Mutation]:
        """Replace the operator written between two operands (only when nothing else is there)."""
        _, start = self.span(left)
        end, _ = self.span(right)
        gap = self.source[start:end].decode("utf-8", "replace")
        if _clean(gap) != old:
            return
        pattern = r"\s+".join(re.escape(word) for word in old.split())
        replaced = re.sub(pattern, new, gap, count=1)
        yield self.make(kind, left.end_lineno, start, end, replaced.encode(), f"`{old}` -> `{new}`")

    def constant(self, node: ast.Constant) -> Iterator[Mutation]:
        start, end = self.span(node)
        value = node.value
        if isinstance(value, bool):
            new = "False" if value else "True"
            yield self.make("constant", node.lineno, start, end, new.encode(), f"`{value}` -> `{new}`")
        elif isinstance(value, int) and self.text(node).isdigit():
            for new in (value + 1, value - 1):
                if new >= 0:
                    yield self.make("boundary", node.lineno, start, end, str(new).encode(), f"`{value}` -> `{new}`")
        elif isinstance(value, str) and value and node.lineno == node.end_lineno:
            yield self.make("constant", node.lineno, start, end, b'""', "a string emptied")

    def swap(self, node: ast.Call) -> Iterator[Mutation]:
        args = node.args
        if len(args) < 2 or any(isinstance(a, ast.Starred) for a in args[:2]):
            return
        first, second = self.text(args[0]), self.text(args[1])
        if first == second:
            return
        start, middle_start = self.span(args[0])
        middle_end, end = self.span(args[1])
        middle = self.source[middle_start:middle_end]
        yield self.make("swap_arguments", args[0].lineno, start, end, second + middle + first, "arguments swapped")

    def early_return(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[Mutation]:
        body = node.body[1:] if _is_docstring_expr(node.body[0]) else node.body
        if len(body) < 2 or not isinstance(body[-1], ast.Return) or not isinstance(body[-1].value, ast.Name):
            return
        before = body[-2]
        if before.lineno == body[-1].lineno:
            return
        start = self.offset(before.lineno, before.col_offset)
        indent = self.source[self.line_starts[before.lineno - 1] : start]
        if indent.strip():
            return  # the statement does not start its line
        name = body[-1].value.id.encode()
        yield self.make("early_return", before.lineno, start, start, b"return " + name + b"\n" + indent,
                        f"`return {body[-1].value.id}` too early")  # fmt: skip


def _clean(gap: str) -> str:
    """The operator text between two operands: brackets, spaces and line continuations removed."""
    return " ".join(re.sub(r"[()\\]", " ", gap).split())


def _is_docstring_expr(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """Ids of nodes no mutation touches (module docstring)."""
    skipped: set[int] = set()

    def skip(node: ast.AST | None) -> None:
        if node is not None:
            skipped.update(id(child) for child in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            if node.body and _is_docstring_expr(node.body[0]):
                skip(node.body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip(node.returns)
            for arg in [*node.args.args, *node.args.posonlyargs, *node.args.kwonlyargs,
                        node.args.vararg, node.args.kwarg]:  # fmt: skip
                if arg is not None:
                    skip(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            skip(node.annotation)
        elif isinstance(node, ast.JoinedStr):
            skip(node)
        elif isinstance(node, ast.If) and _is_guard(node.test):
            skip(node)
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__") for t in node.targets
        ):
            skip(node)
    return skipped


def _is_guard(test: ast.AST) -> bool:
    """`__name__ == "__main__"` or `TYPE_CHECKING` (also `typing.TYPE_CHECKING`)."""
    text = ast.unparse(test)
    return "__main__" in text or text.endswith("TYPE_CHECKING")
