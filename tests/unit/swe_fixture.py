"""A tiny pure-Python package with a pytest suite, for the swe tests (written to a tmp folder by
the tests, so that gapless's own test run never collects its tests)."""

from __future__ import annotations

from pathlib import Path

TINY_PACKAGE = {
    "pyproject.toml": """\
[project]
name = "tinystats"
version = "0.1.0"

[tool.pytest.ini_options]
testpaths = ["tests"]
""",
    "tinystats/__init__.py": "from tinystats.core import chunks, clamp, is_sorted, mean, running_total\n",
    "tinystats/core.py": '''\
"""Small numeric helpers."""


def mean(values):
    if not values:
        raise ValueError("mean of an empty sequence")
    return sum(values) / len(values)


def clamp(value, low, high):
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value


def running_total(values):
    total = 0
    out = []
    for value in values:
        total += value
        out.append(total)
    return out


def chunks(items, size):
    if size <= 0:
        raise ValueError("size must be positive")
    return [items[i : i + size] for i in range(0, len(items), size)]


def is_sorted(items):
    return all(items[i] <= items[i + 1] for i in range(len(items) - 1))
''',
    "tinystats/text.py": '''\
"""Small text helpers."""


def title_words(text):
    return " ".join(word[:1].upper() + word[1:] for word in text.split(" "))


def count_vowels(text):
    return sum(1 for char in text.lower() if char in "aeiou")
''',
    "tests/conftest.py": """\
import pytest


@pytest.fixture
def numbers():
    return [3, 1, 4, 1, 5]
""",
    "tests/test_core.py": """\
import pytest

from tinystats import chunks, clamp, is_sorted, mean, running_total


def test_mean(numbers):
    assert mean(numbers) == 2.8


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-1, 0, 10) == 0


def test_clamp_high():
    assert clamp(11, 0, 10) == 10


def test_clamp_bad_bounds():
    with pytest.raises(ValueError):
        clamp(1, 2, 1)


def test_running_total(numbers):
    assert running_total(numbers) == [3, 4, 8, 9, 14]


@pytest.mark.parametrize("size,expected", [(2, [[1, 2], [3, 4], [5]]), (5, [[1, 2, 3, 4, 5]])])
def test_chunks(size, expected):
    assert chunks([1, 2, 3, 4, 5], size) == expected


def test_chunks_bad_size():
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_is_sorted():
    assert is_sorted([1, 1, 2])
    assert not is_sorted([2, 1])
""",
    "tests/test_text.py": """\
from tinystats.text import count_vowels, title_words


def test_title_words():
    assert title_words("hello big world") == "Hello Big World"


def test_count_vowels():
    assert count_vowels("Education") == 5
""",
}
TINY_PASSING = 13  # tests of TINY_PACKAGE, all passing


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
