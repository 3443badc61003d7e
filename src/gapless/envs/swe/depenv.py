"""Dependency trees for test jobs: a site-packages folder the sandbox's interpreter imports from.

An instance's `env_path` holds pytest and whatever the package's tests import, installed for the
sandbox's Python (`sandbox.python`, /usr/bin/python3 by default), which is not the host's venv.
Two ways to make one:
- `pip_install(dest, requirements, python)`: `pip install --target dest` for that Python (the
  index must be reachable), then `compile_tree`;
- `copy_installed(dest, names)`: copy distributions already installed for the running
  interpreter, with their requirements (markers evaluated here), for offline use when its
  Python version is the sandbox's (the fast tests do this with pytest).
`compile_tree` writes unchecked-hash .pyc files: a job's copy of a file has a new mtime, so
timestamp-checked ones would be recompiled in every job.

Guaranteed: `dest` is written only when complete (built beside it, then renamed). NOT checked:
that the requirements are the ones the package's tests really need (the build finds out when
its tests run).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterable

from packaging.requirements import Requirement


class EnvBuildFailed(RuntimeError):
    """pip or the compiler failed; the message holds its last output lines."""


def sandbox_python_version(python: str) -> tuple[int, int]:
    out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    major, minor = out.split()
    return int(major), int(minor)


def pip_install(dest: Path, requirements: Iterable[str], python: str, timeout_s: float = 600.0) -> Path:
    """Install `requirements` (pip specifiers) into `dest` for `python`, with this
    interpreter's pip (the sandbox's may have none): as is when the Python versions agree,
    else wheels only, for `python`'s version."""
    staging = _staging(dest)
    requirements = list(requirements)
    version = sandbox_python_version(python)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
               "--no-warn-script-location", "--target", str(staging)]  # fmt: skip
    if version != sys.version_info[:2]:
        command += ["--python-version", f"{version[0]}.{version[1]}", "--only-binary", ":all:"]
    done = subprocess.run([*command, *requirements], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise EnvBuildFailed(f"pip install {' '.join(requirements)} failed: {done.stderr.strip()[-1500:]}")
    return _finish(staging, dest, python)


def copy_installed(dest: Path, names: Iterable[str], python: str = sys.executable) -> Path:
    """Copy the installed distributions `names` and their requirements into `dest`."""
    staging = _staging(dest)
    seen: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(name)
        for file in dist.files or ():
            source = Path(dist.locate_file(file))
            if ".." in Path(file).parts or "__pycache__" in Path(file).parts or not source.is_file():
                continue  # console scripts live outside site-packages
            target = staging / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return _finish(staging, dest, python)


def compile_tree(root: Path, python: str) -> None:
    """Unchecked-hash .pyc files for every module under `root`, for `python`'s version."""
    done = subprocess.run(
        [python, "-m", "compileall", "-q", "-f", "-j", "0", "--invalidation-mode", "unchecked-hash", str(root)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:  # a module of a test dependency that does not compile: leave it as source
        lines = (done.stdout + done.stderr).strip().splitlines()
        if not all("SyntaxError" in line or line.startswith(("***", "  ", "Sorry")) or not line for line in lines):
            raise EnvBuildFailed(f"compileall failed in {root}: {' | '.join(lines[-5:])}")


def _staging(dest: Path) -> Path:
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _finish(staging: Path, dest: Path, python: str) -> Path:
    shutil.rmtree(staging / "bin", ignore_errors=True)
    compile_tree(staging, python)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest
