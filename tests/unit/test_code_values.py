"""The host's parse of what the sandbox sends back never raises, and plain values round-trip.

Property tests throw random and adversarial bytes at `parse_report` (the report channel as the
code environment reads it) and at `decode` (the candidate's answers as the judge reads them):
whatever the bytes, the result is a bounded record, never an exception.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gapless.envs.code.environment import parse_report
from gapless.envs.code.values import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    Malformed,
    Unrepresentable,
    decode,
    encode,
    loads_bounded,
)

EXPECTED = ("1", "[1, 2]", '{"a": true}')
ADVERSARIAL = [
    b'{"i": 0, "out": ' + b"9" * 5000 + b"}",  # past Python's int-str conversion limit
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in a plain json.loads
    b'{"i": 0, "out": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}",
    b'{"i": 0, "out": "' + b"[" * 5000 + b'"}',  # brackets inside a string are not nesting
    b'{"i": 0, "out": 1e999999}',
    b'{"i": 0, "out": NaN}\n{"i": 1, "out": -Infinity}',
    b'{"compile_error": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"i": true, "out": 1}',  # a bool is not an index
    b'{"i": 0}\n{"i": 0, "out": 1}',  # the first record of a test counts
    b"\xff\xfe\x00" * 1000,
    b'{"i": 0, "out": "\\ud800"}',  # a lone surrogate
    b'"unterminated [[[[' + b"[" * 200,
]


def test_adversarial_reports_are_scored_not_raised():
    for report in ADVERSARIAL:
        result = parse_report(report, EXPECTED)
        assert 0 <= result.passed <= len(EXPECTED) and result.malformed >= 0


def test_huge_integer_and_deep_nesting_are_malformed_lines():
    assert parse_report(ADVERSARIAL[0], EXPECTED).malformed == 1
    assert parse_report(ADVERSARIAL[1], EXPECTED).malformed == 1
    assert parse_report(ADVERSARIAL[3], EXPECTED).malformed == 0  # just a string


def test_report_parser_counts_passes_once():
    report = b'{"i": 0, "out": 1}\n{"i": 0, "out": 5}\n{"i": 1, "out": [1, 2]}\n{"i": 2, "error": "E"}\n'
    assert tuple(parse_report(report, EXPECTED)) == (2, True, None, 0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_random_bytes_never_raise(report):
    parse_report(report, EXPECTED)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            json_values.map(lambda v: json.dumps({"i": 0, "out": v}).encode()),
            st.integers(0, 6000).map(lambda n: b'{"i": 1, "out": ' + b"7" * n + b"}"),
            st.integers(0, 3000).map(lambda n: b"[" * n + b"]" * n),
            st.binary(max_size=64),
        ),
        max_size=8,
    )
)
def test_mixed_record_streams_never_raise(lines):
    parse_report(b"\n".join(lines), EXPECTED)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048) | st.text(max_size=2048))
def test_decode_never_raises_but_malformed(data):
    try:
        decode(data)
    except Malformed:
        pass


plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.complex_numbers(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.frozensets(st.integers() | st.text(max_size=5), max_size=4)
        | st.dictionaries(st.integers() | st.text(max_size=5) | st.tuples(st.integers()), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(plain_values)
def test_plain_values_round_trip_with_their_types(value):
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_bounds_are_enforced_on_both_sides():
    nested: list = []
    for _ in range(MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(Unrepresentable):
        encode(nested)
    with pytest.raises(Unrepresentable):
        encode(10 ** (MAX_INT_DIGITS + 10))
    with pytest.raises(Unrepresentable):
        encode(object())
    with pytest.raises(Malformed):
        loads_bounded("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    with pytest.raises(Malformed):
        decode('{"__eq__": 1}')  # an object that is not a tagged value
    assert decode(encode(float("nan"))) != decode(encode(float("nan")))  # still a real NaN
    assert decode(encode({(1, 2): {3}})) == {(1, 2): {3}}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=64),
            plain_values.map(lambda v: json.dumps({"i": 0, "value": encode(v)}).encode()),
            st.text(max_size=64).map(lambda t: json.dumps({"i": 1, "value": t}).encode()),
            st.integers(0, 6000).map(lambda n: json.dumps({"i": 2, "value": "7" * n}).encode()),
        ),
        max_size=6,
    )
)
def test_typed_reports_never_raise(lines):
    parse_report(b"\n".join(lines), EXPECTED, typed_expected=((1, 2), {"a": {3}}, 7))
