"""SWE task instances: the record, and the JSONL loader for `task.path` (`task.name = 'swe'`).

One line of the file is one instance, in SWE-bench's field names, so that a set gapless built
(`gapless swe build`) and a user's SWE-bench-format file load the same way:

    instance_id        unique name, e.g. "attrs-1.2.3__mut-0007"
    repo               the project's name (informational: nothing is cloned)
    base_commit        the revision the snapshot stands for (informational; "" allowed)
    patch              the reference fix, a unified diff against the snapshot (never shown to the agent)
    test_patch         a unified diff that restores the hidden tests (applied only when grading)
    problem_statement  what the agent is told
    FAIL_TO_PASS       test ids (pytest node ids) that fail on the snapshot and must pass after the fix
    PASS_TO_PASS       test ids that pass on the snapshot and must still pass

FAIL_TO_PASS / PASS_TO_PASS may be a JSON list or, as SWE-bench's own files store them, a string
holding a JSON list. gapless's own fields:

    repo_path          the snapshot: a directory or a .tar/.tar.gz/.tgz file, relative to the
                       JSONL file's folder or absolute (required: nothing is cloned)
    env_path           optional: a directory of installed test dependencies (a site-packages
                       tree), mounted read-only on the sandbox's Python path; relative as above
    test_command       optional: the runner, default "python -m pytest"

Guaranteed: every problem is reported as `LoadError` naming `file:line` and the field, and nothing
else is read from the file once a line is bad (all or nothing). Not checked here: that the patches
apply or that the tests fail and pass as claimed (the build validates its own instances; a user's
file is trusted on that point).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TEST_COMMAND = "python -m pytest"
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_REQUIRED_TEXT = ("instance_id", "repo", "patch", "test_patch", "problem_statement")


class LoadError(ValueError):
    """A bad instance file: the message names `file:line` and the field."""


@dataclass(frozen=True)
class SweInstance:
    instance_id: str
    repo: str
    base_commit: str
    patch: str
    test_patch: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    repo_path: Path
    env_path: Path | None = None
    test_command: str = DEFAULT_TEST_COMMAND

    def to_json(self, relative_to: Path | None = None) -> dict[str, Any]:
        """The instance as one JSONL line's object; paths relative to `relative_to` if given."""

        def rel(path: Path | None) -> str | None:
            if path is None:
                return None
            if relative_to is not None and path.is_relative_to(relative_to):
                return str(path.relative_to(relative_to))
            return str(path)

        record: dict[str, Any] = {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "base_commit": self.base_commit,
            "patch": self.patch,
            "test_patch": self.test_patch,
            "problem_statement": self.problem_statement,
            "FAIL_TO_PASS": list(self.fail_to_pass),
            "PASS_TO_PASS": list(self.pass_to_pass),
            "repo_path": rel(self.repo_path),
            "test_command": self.test_command,
        }
        if self.env_path is not None:
            record["env_path"] = rel(self.env_path)
        return record


def load_instances(path: str | Path) -> list[SweInstance]:
    """Every instance of a JSONL file, in file order; blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise LoadError(f"{path}: cannot read the instance file ({exc.strerror}); check task.path") from None
    except UnicodeDecodeError:
        raise LoadError(f"{path}: not UTF-8 text; an instance file is JSON lines") from None
    instances: list[SweInstance] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        instance = parse_instance(line, path.parent, where=f"{path}:{number}")
        if instance.instance_id in seen:
            raise LoadError(
                f"{path}:{number}: instance_id {instance.instance_id!r} repeats line {seen[instance.instance_id]}"
            )
        seen[instance.instance_id] = number
        instances.append(instance)
    if not instances:
        raise LoadError(f"{path}: no instances; the file is empty")
    return instances


def parse_instance(line: str, base: Path, where: str) -> SweInstance:
    """One JSONL line; relative paths resolve against `base`; errors name `where`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LoadError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise LoadError(f"{where}: a line must be a JSON object, not {type(record).__name__}")
    for field in _REQUIRED_TEXT:
        if not isinstance(record.get(field), str):
            raise LoadError(f"{where}: field {field!r} must be a string{_missing(record, field)}")
    if not record["instance_id"].strip():
        raise LoadError(f"{where}: field 'instance_id' is empty")
    fail_to_pass = _test_ids(record, "FAIL_TO_PASS", where)
    if not fail_to_pass:
        raise LoadError(f"{where}: field 'FAIL_TO_PASS' is empty; an instance needs a test that the fix makes pass")
    repo_path = _path(record, "repo_path", base, where)
    if repo_path is None:
        raise LoadError(
            f"{where}: field 'repo_path' is missing; give the repository as a local directory or tarball "
            "(gapless clones nothing)"
        )
    if not (repo_path.is_dir() or (repo_path.is_file() and repo_path.name.endswith(ARCHIVE_SUFFIXES))):
        raise LoadError(f"{where}: field 'repo_path': {repo_path} is neither a directory nor a .tar/.tar.gz/.tgz file")
    env_path = _path(record, "env_path", base, where)
    if env_path is not None and not env_path.is_dir():
        raise LoadError(f"{where}: field 'env_path': {env_path} is not a directory")
    test_command = record.get("test_command", DEFAULT_TEST_COMMAND)
    if not isinstance(test_command, str) or not test_command.strip():
        raise LoadError(f"{where}: field 'test_command' must be a non-empty string")
    base_commit = record.get("base_commit", "")
    if not isinstance(base_commit, str):
        raise LoadError(f"{where}: field 'base_commit' must be a string")
    return SweInstance(
        instance_id=record["instance_id"],
        repo=record["repo"],
        base_commit=base_commit,
        patch=record["patch"],
        test_patch=record["test_patch"],
        problem_statement=record["problem_statement"],
        fail_to_pass=fail_to_pass,
        pass_to_pass=_test_ids(record, "PASS_TO_PASS", where),
        repo_path=repo_path,
        env_path=env_path,
        test_command=test_command,
    )


def _missing(record: dict[str, Any], field: str) -> str:
    return " (it is missing)" if field not in record else f" (it is {type(record[field]).__name__})"


def _test_ids(record: dict[str, Any], field: str, where: str) -> tuple[str, ...]:
    value = record.get(field, [])
    if isinstance(value, str):  # SWE-bench stores the lists as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise LoadError(f"{where}: field {field!r} is a string but not a JSON list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise LoadError(f"{where}: field {field!r} must be a list of test ids (non-empty strings)")
    return tuple(value)


def _path(record: dict[str, Any], field: str, base: Path, where: str) -> Path | None:
    value = record.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise LoadError(f"{where}: field {field!r} must be a path string")
    path = Path(value)
    return path if path.is_absolute() else base / path
