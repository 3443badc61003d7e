"""Run a repository's pytest suite, or a selection of its tests, in one sandbox job.

`run_tests(sandbox, repo, test_ids, env)` ships the repository tree (a directory, a tarball, or
a mapping of relative path -> bytes), the dependency tree `env` (a site-packages folder: an
instance's `env_path`, holding pytest and the test dependencies) and the trusted runner
(pytest_runner.py) as one job's files, and returns a `TestRun`: the job's `Status` and a typed
outcome per test, `passed | failed | error | skipped | missing`.

Where things are inside the job (all read-only; the runner copies the repository to /tmp/repo,
a writable checkout, and runs pytest there): the sandbox's own interpreter (`sandbox.python`,
/usr/bin/python3 by default: `env` must be installed for that version), `env` first on the
path for the runner's own imports, then the repository root (as `python -m pytest` puts its
cwd first) and, for a src layout, `src/`.

Outcomes. With `test_ids`, every requested id gets one: what its test's phases gave (setup
failed: error; call failed: failed; skipped or xfail: skipped; teardown failed: error), error
when the module holding it did not import, missing when no test of that id finished (not
collected, its file absent, or the job ended first: a timeout keeps the tests that finished
before it). Without `test_ids` the whole suite runs and every test that finished is listed.
A selection runs only the files of the requested ids, deselecting the rest, so a missing id
never stops the others (pytest refuses a command line naming an unknown id).

Guaranteed, against code in the repository (conftest.py, test files, the package itself):
- the host reads outcomes from the job's report pipe, parses them as untrusted text (bounded,
  never an exception) and counts a test as passed only on a well-formed `passed` line signed
  with the key the runner wrote first, before any repository code was in its process (a line
  without that signature marks the run `tampered`); a crash, an early exit, a kill or a
  timeout loses tests (missing), never adds passes;
- pytest, pluggy and the recorder come from `env`, never from the repository (a planted
  `pytest.py`, `_pytest/`, `*.dist-info` entry point or `-p` plugin module in the repository
  is not the runner; entry-point autoloading is off); `.pth`, `sitecustomize.py` and
  `usercustomize.py` files anywhere in the job are never executed;
- the recorder is registered before any conftest.py is read; a test reported twice, a line
  the runner does not write, a replaced runner function, or an outcome-deciding hook
  (`pytest_runtest_makereport` and the like) implemented outside `env`, pytest and the
  trusted `hook_files` marks the run `tampered`, and every outcome is then error.
NOT guaranteed: code that runs in the test process can do anything that process can, including
finding the runner's key in its memory and writing signed lines, or defeating the tamper check
itself; the signature and the check stop code that knows the report's format and the obvious
patches, not a determined forger that introspects the runner. A grader must therefore take everything
that decides how tests run (test files, every conftest.py, pytest's configuration files:
pytest.ini, tox.ini, setup.cfg, pyproject.toml) from the trusted snapshot and the test patch,
and pass those conftest.py files as `hook_files`; what is left to the agent's code is then
the package's own modules, which can still patch pytest at import time past this check.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shlex
import tarfile
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Mapping, Sequence

from gapless.sandbox import SandboxLimits, Status

RUNNER_SOURCE = Path(__file__).with_name("pytest_runner.py").read_bytes()
RUNNER = "gapless_runner.py"
DEFAULT_LIMITS = SandboxLimits(timeout_s=120.0, memory_mb=2048, tmp_size_mb=256, max_files=20000)
_SKIPPED_PARTS = frozenset({".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".tox", ".nox", ".mypy_cache"})
_PYTEST_COMMANDS = (("python", "-m", "pytest"), ("python3", "-m", "pytest"), ("pytest",), ("py.test",))

Tree = Mapping[str, bytes]


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    MISSING = "missing"


@dataclass(frozen=True)
class TestRun:
    """What one test job gave. `outcomes` is the only thing a grader should read."""

    __test__ = False  # not a pytest test class, whatever its name

    outcomes: dict[str, Outcome]
    status: Status  # the job's: ok when the runner finished, else why it did not
    is_complete: bool  # pytest ran to its end and the runner wrote its footer
    exit_code: int | None  # pytest's exit code, when complete
    tampered: str | None = None  # why the report cannot be trusted (module docstring)
    messages: dict[str, str] = field(default_factory=dict)  # failed/error test -> trimmed text
    collected: int | None = None  # tests pytest selected to run
    output: str = ""  # the job's stdout and stderr, capped
    wall_s: float = 0.0

    def is_passed(self, test_id: str) -> bool:
        return self.tampered is None and self.outcomes.get(test_id) is Outcome.PASSED

    def with_outcome(self, wanted: Outcome) -> list[str]:
        return sorted(test_id for test_id, outcome in self.outcomes.items() if outcome is wanted)


def run_tests(
    sandbox,
    repo: Tree | Path,
    test_ids: Sequence[str] | None = None,
    env: Tree | Path | None = None,
    limits: SandboxLimits = DEFAULT_LIMITS,
    test_command: str = "python -m pytest",
    hook_files: Sequence[str] | None = None,
    suite_paths: Sequence[str] = (),
) -> TestRun:
    """Run `test_ids` (pytest node ids; None: the whole suite, or the tests under `suite_paths`)
    of `repo` with `env` on the path, in one job of `sandbox` (a `BwrapSandbox`). `hook_files`:
    repository files allowed to implement outcome-deciding hooks (default: every conftest.py of
    `repo`; a grader passes the trusted snapshot's). Raises ValueError only for a
    `test_command` that is not pytest's; everything the repository's code does is a status."""
    extra_args = pytest_args(test_command)
    files = repo if isinstance(repo, Mapping) else load_tree(repo)
    env_files = {} if env is None else env if isinstance(env, Mapping) else load_env(env)
    wanted = None if test_ids is None else list(dict.fromkeys(test_ids))
    paths = (
        list(suite_paths) if wanted is None else [p for p in dict.fromkeys(_file_of(t) for t in wanted) if p in files]
    )
    if wanted is not None and not paths:  # nothing to run: no file of any requested test exists
        return TestRun({t: Outcome.MISSING for t in wanted}, Status.OK, True, None, collected=0)
    request = {
        "test_ids": wanted,
        "paths": paths,
        "args": extra_args,
        "python_path": python_path(files),
        "hook_files": sorted(hook_files if hook_files is not None else [p for p in files if _is_conftest(p)]),
    }
    job: dict[str, str | bytes] = {RUNNER: RUNNER_SOURCE, "request.json": json.dumps(request)}
    job.update({f"repo/{path}": content for path, content in files.items()})
    job.update({f"env/{path}": content for path, content in env_files.items()})
    result = sandbox.run_python(job, RUNNER, limits=limits)
    output = (result.stdout + result.stderr)[-limits.max_output_bytes :]
    return parse_report(result.report, wanted, result.status, output, result.wall_s)


def parse_report(report: bytes, wanted: Sequence[str] | None, status: Status, output: str = "",
                 wall_s: float = 0.0) -> TestRun:  # fmt: skip
    """The runner's report (untrusted bytes) as a `TestRun`; never raises."""
    reported: dict[str, Outcome] = {}
    broken: dict[str, str] = {}  # node id of a collector that failed -> its text
    messages: dict[str, str] = {}
    collected = exit_code = tampered = None
    is_complete = False
    lines = report.decode("utf-8", errors="replace").splitlines()
    key = _key(lines[0]) if lines else None
    if lines and key is None:
        tampered = "the report does not start with the runner's key"
    for raw in lines[1:]:
        line = _record(raw, key)
        if line is None or is_complete:
            tampered = tampered or (
                "a report line after the footer" if line is not None else "a malformed or unsigned report line"
            )
            continue
        if "collected" in line and isinstance(line["collected"], int) and collected is None:
            collected = line["collected"]
        elif "end" in line and isinstance(line["end"], int):
            exit_code, is_complete = line["end"], True
            tampered = tampered or (line.get("tamper") if isinstance(line.get("tamper"), str) else None)
        elif isinstance(line.get("t"), str) and line.get("o") in _OUTCOMES:
            test_id, outcome = line["t"], Outcome(line["o"])
            if test_id in reported or test_id in broken:
                tampered = tampered or f"{test_id[:200]} reported twice"
            if isinstance(line.get("m"), str):
                messages[test_id] = line["m"]
            if line.get("collect") is True:
                broken[test_id] = messages.get(test_id, "")
            else:
                reported[test_id] = outcome
        else:
            tampered = tampered or "a report line the runner does not write"
    if wanted is None:
        outcomes = {**{node: Outcome.ERROR for node in broken}, **reported}
    else:
        outcomes = {t: reported.get(t) or (Outcome.ERROR if _is_under(t, broken) else Outcome.MISSING) for t in wanted}
        messages = {t: messages.get(t) or _broken_text(t, broken) for t in wanted if outcomes[t] in _BAD}
    if tampered is not None:
        outcomes = dict.fromkeys(outcomes, Outcome.ERROR)
    messages = {t: m for t, m in messages.items() if m}
    return TestRun(outcomes, status, is_complete, exit_code, tampered, messages, collected, output, wall_s)


_OUTCOMES = frozenset(o.value for o in Outcome if o is not Outcome.MISSING)
_BAD = (Outcome.FAILED, Outcome.ERROR)


def _key(raw: str) -> bytes | None:
    try:
        value = json.loads(raw)
        return bytes.fromhex(value["key"]) if isinstance(value, dict) and len(value["key"]) == 64 else None
    except (ValueError, RecursionError, KeyError, TypeError):
        return None


def _record(raw: str, key: bytes | None) -> dict | None:
    """A signed line's record; None for a line that is malformed or not signed with `key`."""
    mac, _, body = raw.partition(" ")
    expected = hmac.new(key, body.encode(), hashlib.sha256).hexdigest().encode() if key is not None else b""
    if key is None or not hmac.compare_digest(mac.encode(), expected):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _is_under(test_id: str, broken: Mapping[str, str]) -> bool:
    return any(test_id == node or test_id.startswith(node + "::") for node in broken)


def _broken_text(test_id: str, broken: Mapping[str, str]) -> str:
    return next((text for node, text in broken.items() if test_id.startswith(node + "::")), "")


def _file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def _is_conftest(path: str) -> bool:
    return PurePosixPath(path).name == "conftest.py"


def pytest_args(test_command: str) -> list[str]:
    """The extra pytest arguments of an instance's `test_command` (ValueError unless it runs pytest)."""
    try:
        words = shlex.split(test_command)
    except ValueError as exc:
        raise ValueError(f"test_command {test_command!r} does not parse as a shell command ({exc})") from None
    for prefix in _PYTEST_COMMANDS:
        if tuple(words[: len(prefix)]) == prefix:
            return words[len(prefix) :]
    raise ValueError(f"test_command {test_command!r} must run pytest (e.g. 'python -m pytest [ARGS]')")


def python_path(files: Tree) -> list[str]:
    """Repository folders put first on the path: its root, and `src` for a src layout."""
    has_src_package = any(
        len(parts) == 3 and parts[0] == "src" and parts[2] == "__init__.py"
        for parts in (PurePosixPath(p).parts for p in files)
    )
    return [".", "src"] if has_src_package else ["."]


def load_tree(path: str | Path) -> dict[str, bytes]:
    """A repository's regular files (relative path -> bytes) from a directory or a tarball
    (.tar, .tar.gz, .tgz; a single top folder holding everything is taken as the root).
    Version-control and cache folders are left out; symbolic links too (a job holds files)."""
    path = Path(path)
    if path.is_dir():
        files = {}
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_PARTS)
            for name in sorted(names):
                full = Path(folder, name)
                if full.is_file() and not full.is_symlink() and not name.endswith((".pyc", ".pyo")):
                    files[full.relative_to(path).as_posix()] = full.read_bytes()
        return files
    return _load_tarball(path)


def _load_tarball(path: Path) -> dict[str, bytes]:
    files = {}
    with tarfile.open(path) as archive:
        for member in archive:
            name = PurePosixPath(member.name)
            if (not member.isfile() or name.is_absolute() or ".." in name.parts
                    or _SKIPPED_PARTS.intersection(name.parts)):  # fmt: skip
                continue
            handle = archive.extractfile(member)
            if handle is not None:
                files[str(name)] = handle.read()
    tops = {PurePosixPath(name).parts[0] for name in files}
    if len(tops) == 1 and all(len(PurePosixPath(n).parts) > 1 for n in files):
        top = tops.pop()
        files = {str(PurePosixPath(name).relative_to(top)): data for name, data in files.items()}
    return files


_ENV_CACHE: dict[tuple[str, int], dict[str, bytes]] = {}
_ENV_LOCK = threading.Lock()


def load_env(path: str | Path) -> dict[str, bytes]:
    """A dependency tree's files, kept in memory per (path, folder mtime): every test job ships
    it. Compiled files are kept (compile them with `--invalidation-mode unchecked-hash`: the
    job's copies have new mtimes, so timestamp-checked ones are recompiled in every job)."""
    path = Path(path).resolve()
    key = (str(path), path.stat().st_mtime_ns)
    with _ENV_LOCK:
        cached = _ENV_CACHE.get(key)
    if cached is not None:
        return cached
    files = {}
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not (d == "bin" and Path(folder) == path))  # pip's scripts
        for name in sorted(names):
            full = Path(folder, name)
            if full.is_file() and not full.is_symlink():
                files[full.relative_to(path).as_posix()] = full.read_bytes()
    with _ENV_LOCK:
        _ENV_CACHE[key] = files
    return files
