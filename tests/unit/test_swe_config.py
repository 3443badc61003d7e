"""`task.name = "swe"` from the config: a missing default set and a test command that is not
pytest's are config errors naming the field, raised before any sandbox starts."""

from __future__ import annotations

import json

import pytest

from gapless.config import Config, ConfigError
from gapless.envs.swe.environment import make_swe_environment


def test_without_a_path_or_a_built_default_set(tmp_path, monkeypatch):
    monkeypatch.setenv("GAPLESS_SWE_SET", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=r"task\.path: .*setup\.sh"):
        make_swe_environment(Config(task={"name": "swe"}))


def test_a_test_command_that_is_not_pytest(tmp_path):
    (tmp_path / "repo").mkdir()
    line = {"instance_id": "x", "repo": "r", "patch": "", "test_patch": "", "problem_statement": "p",
            "FAIL_TO_PASS": ["t.py::t"], "repo_path": "repo", "test_command": "make test"}  # fmt: skip
    (tmp_path / "i.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=r"task\.path: instance 'x': .*must run pytest"):
        make_swe_environment(Config(task={"name": "swe", "path": str(tmp_path / "i.jsonl")}))
