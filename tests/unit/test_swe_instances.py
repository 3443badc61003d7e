"""The SWE instance loader: SWE-bench's field names in, typed records out, `file:line` errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gapless.envs.swe.instances import LoadError, load_instances


def _line(**overrides) -> str:
    record = {
        "instance_id": "pkg__mut-1",
        "repo": "pkg",
        "base_commit": "1.0",
        "patch": "--- a/x.py\n+++ b/x.py\n",
        "test_patch": "",
        "problem_statement": "test_x fails",
        "FAIL_TO_PASS": ["tests/test_x.py::test_x"],
        "PASS_TO_PASS": ["tests/test_x.py::test_y"],
        "repo_path": "repo",
    }
    record.update(overrides)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo.tar.gz").write_bytes(b"")
    return tmp_path


def test_loads_both_list_encodings_and_resolves_paths(folder: Path) -> None:
    swe_bench_style = _line(instance_id="b", FAIL_TO_PASS=json.dumps(["t::a", "t::b"]), repo_path="repo.tar.gz")
    (folder / "set.jsonl").write_text(_line() + "\n\n" + swe_bench_style + "\n")
    first, second = load_instances(folder / "set.jsonl")
    assert first.fail_to_pass == ("tests/test_x.py::test_x",)
    assert first.repo_path == folder / "repo"
    assert first.test_command == "python -m pytest"
    assert second.fail_to_pass == ("t::a", "t::b")
    assert second.repo_path == folder / "repo.tar.gz"
    assert json.loads(json.dumps(first.to_json(folder)))["repo_path"] == "repo"


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        (_line(patch=...), "'patch' must be a string (it is missing)"),
        (_line(FAIL_TO_PASS=[]), "'FAIL_TO_PASS' is empty"),
        (_line(FAIL_TO_PASS="t::a"), "not a JSON list"),
        (_line(PASS_TO_PASS=[1]), "list of test ids"),
        (_line(repo_path=...), "gapless clones nothing"),
        (_line(repo_path="nowhere"), "neither a directory"),
        (_line(env_path="nowhere"), "'env_path'"),
    ],
)
def test_a_bad_line_names_file_line_and_field(folder: Path, line: str, words: str) -> None:
    (folder / "set.jsonl").write_text(_line(instance_id="ok") + "\n" + line + "\n")
    with pytest.raises(LoadError) as caught:
        load_instances(folder / "set.jsonl")
    assert "set.jsonl:2: " in str(caught.value)
    assert words in str(caught.value)


def test_a_repeated_id_and_an_empty_file_are_refused(folder: Path) -> None:
    (folder / "set.jsonl").write_text(_line() + "\n" + _line() + "\n")
    with pytest.raises(LoadError, match="set.jsonl:2: instance_id 'pkg__mut-1' repeats line 1"):
        load_instances(folder / "set.jsonl")
    (folder / "empty.jsonl").write_text("\n")
    with pytest.raises(LoadError, match="no instances"):
        load_instances(folder / "empty.jsonl")
