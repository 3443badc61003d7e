"""envs/swe/mutate.py and hide.py: one mutation per kind on hand-written code, exact spans, the
seeded order, and hiding tests (pure functions: no sandbox)."""

from __future__ import annotations

import ast
import subprocess

from gapless.envs.swe.hide import hide_tests, problem_statement, unified_diff
from gapless.envs.swe.mutate import KINDS, mutations, ordered, parses

SOURCE = b'''"""Docstring: never mutated."""
__all__ = ["f"]


def f(items, low: int = 0, high: "int" = 10):
    """Docstring too."""
    total = 0
    for item in items:
        if item < low or not item:
            continue
        total += item * 2
    helper(low, high)
    flag = True
    name = f"x{low}"
    return total


def g(n):
    if n == 1 and (n + 1) > 2:
        raise ValueError("bad")
    return n
'''


def mutants(kind: str) -> set[bytes]:
    """The changed line of every mutation of `kind`, as text."""
    found = set()
    for m in mutations("pkg/mod.py", SOURCE):
        if m.kind == kind:
            line = m.apply(SOURCE).splitlines()[m.line - 1].strip()
            found.add(line)
    return found


def test_every_kind_with_its_exact_text():
    assert b"if item <= low or not item:" in mutants("comparison")
    assert b"if n != 1 and (n + 1) > 2:" in mutants("comparison")
    assert b"if n == 1 and (n + 1) >= 2:" in mutants("comparison")
    assert b"total -= item * 2" in mutants("operator") and b"total += item / 2" in mutants("operator")
    assert b"if n == 1 and (n - 1) > 2:" in mutants("operator")
    assert b"if item < low and not item:" in mutants("boolean")
    assert b"if item < low or item:" in mutants("condition")
    assert b"if not (n == 1 and (n + 1) > 2):" in mutants("condition")
    assert {b"total = 1", b"total += item * 3", b"total += item * 1"} <= mutants("boundary")
    assert {b"flag = False", b'raise ValueError("")'} <= mutants("constant")
    assert {b"pass"} == mutants("remove_statement")
    assert mutants("swap_arguments") == {b"helper(high, low)"}
    assert mutants("early_return") == {b"return total", b"return n"}  # g: before its guard
    assert set(KINDS) == {m.kind for m in mutations("pkg/mod.py", SOURCE)}


def test_docstrings_annotations_fstrings_and_dunders_are_left_alone():
    fstring = SOURCE.index(b'f"x{low}"')
    for m in mutations("pkg/mod.py", SOURCE):
        changed = SOURCE[m.start : m.end]
        assert b"Docstring" not in changed and b'"int"' not in changed and b"__all__" not in changed
        assert m.kind == "remove_statement" or not (m.start < fstring + 9 and m.end > fstring)


def test_every_mutant_parses_and_differs_in_one_span():
    found = mutations("pkg/mod.py", SOURCE)
    assert len(found) > 30
    for m in found:
        mutant = m.apply(SOURCE)
        assert parses(m, SOURCE)
        ast.parse(mutant)
        assert mutant != SOURCE
        assert (
            mutant[: m.start] == SOURCE[: m.start] and mutant[len(mutant) - (len(SOURCE) - m.end) :] == SOURCE[m.end :]
        )


def test_seeded_order_is_deterministic_and_takes_kinds_in_turn():
    found = mutations("pkg/mod.py", SOURCE)
    first, again = ordered(found, 7), ordered(list(reversed(found)), 7)
    assert [m.key for m in first] == [m.key for m in again]
    assert [m.key for m in first] != [m.key for m in ordered(found, 8)]
    assert len({m.kind for m in first[: len(KINDS)]}) == len(KINDS)


TESTS = b"""import pytest


def test_a():
    assert True


@pytest.mark.parametrize("x", [1, 2])
def test_b(x):
    assert x


class TestC:
    def test_d(self):
        assert True
"""


def test_hide_tests_removes_functions_with_decorators_and_the_diff_restores_them(tmp_path):
    hidden = hide_tests({"tests/test_m.py": TESTS}, ["tests/test_m.py::test_b[1]", "tests/test_m.py::TestC::test_d"])
    text = hidden["tests/test_m.py"]
    assert b"test_b" not in text and b"test_d" not in text and b"parametrize" not in text
    assert b"def test_a" in text and b"class TestC" in text
    ast.parse(text)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_m.py").write_bytes(text)
    (tmp_path / "fix.diff").write_text(unified_diff("tests/test_m.py", text, TESTS))
    subprocess.run(["git", "apply", "fix.diff"], cwd=tmp_path, check=True)
    assert (tmp_path / "tests/test_m.py").read_bytes() == TESTS
    assert hide_tests({"tests/test_m.py": TESTS}, ["tests/test_m.py::test_generated"]) is None


def test_problem_statement_names_tests_and_trims_tracebacks():
    message = "\n".join(f"frame {i}" for i in range(40)) + "\nE   assert 3 == 4"
    text = problem_statement("pkg", ["t.py::test_a", "t.py::test_b", "t.py::c", "t.py::d"], {"t.py::test_a": message})
    assert "`t.py::test_a`" in text and "assert 3 == 4" in text and "frame 0\n" not in text
    assert "1 more: `t.py::d`" in text
