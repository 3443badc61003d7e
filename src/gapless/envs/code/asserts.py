"""Assert tests that can leave the sandbox: `assert f(<literals>) == <literal>` becomes a call whose
result the host compares.

A test source that is exactly one such statement (the entry point or `candidate` called with
literal positional arguments, compared with `==` to a literal, either side) needs no code in the
judge: the judge only calls the candidate with the arguments and reports the result as a typed
plain value (envs/code/values.py), and the host compares it with the literal using Python's `==` on
builtin values, which is what the assert meant (`2 == 2.0` and `True == 1` hold, a tuple is not
a list). `host_compared` converts a task whose every test has that form, or returns None and the
task runs in the judge as before (envs/code/sandbox_scripts/assert_harness.py).

Guaranteed: a conversion keeps the assert's meaning for every result the candidate can send (a
builtin value; anything else has no plain form and fails the test, as a forged `__eq__` would
have to). NOT guaranteed: conversion of any other form (`assert f(x)`, `is`, `<`, messages,
several statements, keyword arguments): those stay in the judge, which is just as closed to the
candidate; this only takes the comparison out of the sandbox altogether.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from functools import lru_cache

from gapless.envs.code.values import Unrepresentable, encode


@dataclass(frozen=True)
class HostComparedTests:
    args: tuple[str, ...]  # one encoded argument list per test (code_values.encode)
    expected: tuple[object, ...]  # the literal each result must equal


@lru_cache(maxsize=4096)
def host_compared(entry_point: str, test_sources: tuple[str, ...]) -> HostComparedTests | None:
    """The tests as calls and expected values, if every one has the convertible form.
    `test_sources`: the asserts harness's test inputs (each a JSON string of a test source)."""
    args, expected = [], []
    for raw in test_sources:
        converted = _convert(entry_point, json.loads(raw))
        if converted is None:
            return None
        args.append(converted[0])
        expected.append(converted[1])
    return HostComparedTests(tuple(args), tuple(expected))


def _convert(entry_point: str, source: str) -> tuple[str, object] | None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert) or tree.body[0].msg is not None:
        return None
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    call, literal = test.left, test.comparators[0]
    if not isinstance(call, ast.Call):
        call, literal = literal, call
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id in (entry_point, "candidate") and not call.keywords):  # fmt: skip
        return None
    try:
        arguments = [ast.literal_eval(argument) for argument in call.args]  # a *starred one: ValueError
        return encode(arguments), ast.literal_eval(literal)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, Unrepresentable):
        return None
