"""A package's source for the task-set build: fetch its sdist, unpack it, tell tests from code.

`fetch(spec, cache)` takes `NAME==VERSION` (the sdist through `pip download --no-binary NAME
--no-deps`, cached under `cache`) or a local sdist (.tar.gz) or folder, and returns a `Source`:
its files, the test files (`test_*.py` / `*_test.py` outside docs, benchmarks and examples), the
source files mutations may touch (the package's modules: not tests, not conftest.py, not build
scripts) and the test requirements it declares (pyproject's `test`/`tests`/`testing` extras and
dependency groups, setup.cfg's extras, requirements files named for tests), minus tools a test run
does not need (coverage, linters, docs).

Guaranteed: a sdist is unpacked without following links or leaving its folder (testrun.load_tree).
NOT guaranteed: that the declared requirements are complete; tests that cannot import are found
by the baseline run and never used.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement

from gapless.envs.swe.testrun import load_tree

_NOT_TEST_DIRS = frozenset({"docs", "doc", "bench", "benchmark", "benchmarks", "examples", "example", "build", "dist"})
_TEST_DIRS = frozenset({"test", "tests", "testing"})
_NOT_SOURCE_NAMES = frozenset({"setup.py", "conftest.py", "noxfile.py", "tasks.py", "fabfile.py", "_version.py",
                               "version.py", "__main__.py", "conf.py"})  # fmt: skip
_NOT_SOURCE_DIRS = _NOT_TEST_DIRS | _TEST_DIRS | frozenset({"scripts", "tools", "ci", ".github"})
_UNNEEDED = re.compile(
    r"^(pytest|pytest-cov|coverage|covdefaults|codecov|tox|nox|pre-commit|mypy|ruff|flake8.*|black|isort|pylint"
    r"|sphinx.*|furo|myst-parser|twine|build|wheel|setuptools|check-manifest|pytest-xdist|pytest-benchmark"
    r"|pytest-codspeed|pytest-mypy.*|types-.*)$",
    re.IGNORECASE,
)
_TEST_EXTRAS = ("test", "tests", "testing")


class SourceError(RuntimeError):
    """The package could not be fetched or holds no tests; the message says which and why."""


@dataclass(frozen=True)
class Source:
    name: str
    version: str
    files: dict[str, bytes]
    test_files: tuple[str, ...]
    source_files: tuple[str, ...]
    requirements: tuple[str, ...]  # pip specifiers for the tests' dependencies (not pytest)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.version}"


def fetch(spec: str, cache: Path) -> Source:
    """The package named by `spec` (module docstring)."""
    local = Path(spec)
    if local.exists():
        files = load_tree(local)
        name, version = _name_version(files, local.name)
    else:
        name, _, version = spec.partition("==")
        if not name or not version or not re.fullmatch(r"[A-Za-z0-9._-]+", name + version):
            raise SourceError(f"package {spec!r}: give NAME==VERSION (a pinned release) or a local sdist or folder")
        files = load_tree(_download(name, version, cache))
    test_files = tuple(sorted(p for p in files if _is_test_file(p)))
    if not test_files:
        raise SourceError(f"package {spec!r}: its source holds no test_*.py or *_test.py file")
    source_files = tuple(sorted(p for p in files if _is_source_file(p)))
    return Source(name, version, files, test_files, source_files, _requirements(files))


def _download(name: str, version: str, cache: Path) -> Path:
    folder = cache / "sdists"
    folder.mkdir(parents=True, exist_ok=True)
    if (found := _sdist_in(folder, name, version)) is not None:
        return found
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-input",
               "--no-deps", "--no-binary", name, "-d", str(folder), f"{name}=={version}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SourceError(f"pip download {name}=={version} failed: {done.stderr.strip()[-800:]}")
    found = _sdist_in(folder, name, version)
    if found is None:
        raise SourceError(f"pip download {name}=={version} wrote no .tar.gz sdist into {folder}")
    return found


def _sdist_in(folder: Path, name: str, version: str) -> Path | None:
    """The sdist of name==version in `folder` (names compared normalised: python_slugify-1.0.tar.gz
    is python-slugify 1.0)."""
    prefix = _normal(f"{name}-{version}") + "-"
    for path in sorted(folder.iterdir()):
        if path.name.endswith((".tar.gz", ".tgz", ".tar")) and _normal(path.name).startswith(prefix):
            return path
    return None


def _normal(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text.lower())


def _name_version(files: dict[str, bytes], fallback: str) -> tuple[str, str]:
    if "pyproject.toml" in files:
        try:
            project = tomllib.loads(files["pyproject.toml"].decode()).get("project", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            project = {}
        if isinstance(project.get("name"), str) and isinstance(project.get("version"), str):
            return project["name"], project["version"]
    stem = fallback.removesuffix(".tar.gz").removesuffix(".tgz").removesuffix(".tar")
    name, _, version = stem.rpartition("-")
    return (name, version) if name and version[:1].isdigit() else (stem, "0")


def _is_test_file(path: str) -> bool:
    parts = PurePosixPath(path).parts
    name = parts[-1]
    return (
        name.endswith(".py")
        and (name.startswith("test_") or name.endswith("_test.py"))
        and not _NOT_TEST_DIRS.intersection(p.lower() for p in parts[:-1])
    )


def _is_source_file(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return (
        parts[-1].endswith(".py")
        and parts[-1] not in _NOT_SOURCE_NAMES
        and not _is_test_file(path)
        and not _NOT_SOURCE_DIRS.intersection(p.lower() for p in parts[:-1])
        and not parts[-1].startswith("test")
    )


def _requirements(files: dict[str, bytes]) -> tuple[str, ...]:
    found: list[str] = []
    if "pyproject.toml" in files:
        try:
            data = tomllib.loads(files["pyproject.toml"].decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            data = {}
        project = data.get("project", {})
        found += project.get("dependencies", []) or []
        for extra in _TEST_EXTRAS:
            found += (project.get("optional-dependencies", {}) or {}).get(extra, []) or []
            found += [g for g in (data.get("dependency-groups", {}) or {}).get(extra, []) or [] if isinstance(g, str)]
    if "setup.cfg" in files:
        parser = configparser.ConfigParser()
        try:
            parser.read_string(files["setup.cfg"].decode())
            for extra in _TEST_EXTRAS:
                found += parser.get("options.extras_require", extra, fallback="").split("\n")
            found += parser.get("options", "install_requires", fallback="").split("\n")
        except (configparser.Error, UnicodeDecodeError):
            pass
    for path, content in files.items():
        name = PurePosixPath(path).name.lower()
        if name.endswith(".txt") and "requirements" in path.lower() and "test" in path.lower():
            found += content.decode("utf-8", "replace").splitlines()
    return tuple(sorted({req for req in (_requirement(text) for text in found) if req}))


def _requirement(text: object) -> str | None:
    """A usable pip specifier, or None (options, includes, tools a test run does not need)."""
    if not isinstance(text, str):
        return None
    text = text.split("#", 1)[0].strip()
    if not text or text.startswith("-"):
        return None
    try:
        requirement = Requirement(text)
    except InvalidRequirement:
        return None
    if _UNNEEDED.match(requirement.name):
        return None
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        return None
    requirement.marker = None
    return str(requirement)
