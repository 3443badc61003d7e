"""A SWE instance over the tiny package of swe_fixture.py, built the way a task set is: a bug in
the package, the test that catches it removed from the snapshot, the test patch restoring it,
the reverse patch as the reference; and the environment over it, for the swe tests."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from sandbox_host import SLOT_UID_BASE, assert_host_clean, host_state
from swe_fixture import TINY_PACKAGE, write_tree

from gapless.envs.swe.depenv import copy_installed, sandbox_python_version
from gapless.envs.swe.environment import SweEnvironment
from gapless.envs.swe.instances import SweInstance, load_instances
from gapless.envs.swe.patches import make_patch
from gapless.envs.swe.testrun import Outcome
from gapless.envs.swe.tools import SweTask, prompt_of
from gapless.sandbox import BwrapSandbox, SandboxLimits

SANDBOX_PYTHON = "/usr/bin/python3"
GOOD = "    return sum(values) / len(values)\n"
BUGGY = "    return sum(values) / (len(values) + 1)\n"
HIDDEN_TEST = "def test_mean(numbers):\n    assert mean(numbers) == 2.8\n\n\n"
FAIL_TO_PASS = ["tests/test_core.py::test_mean"]
PASS_TO_PASS = [
    "tests/test_core.py::test_mean_empty",
    "tests/test_core.py::test_clamp_inside",
    "tests/test_core.py::test_clamp_low",
    "tests/test_core.py::test_clamp_high",
    "tests/test_core.py::test_chunks[2-expected0]",
    "tests/test_text.py::test_title_words",
]


def build_instance(root: Path, env: Path | None) -> Path:
    """Write the snapshot under `root` and `root/instances.jsonl`; returns the file."""
    fixed = {name: text for name, text in TINY_PACKAGE.items()}
    snapshot = dict(fixed)
    snapshot["tinystats/core.py"] = fixed["tinystats/core.py"].replace(GOOD, BUGGY)
    snapshot["tests/test_core.py"] = fixed["tests/test_core.py"].replace(HIDDEN_TEST, "")
    assert (
        snapshot["tinystats/core.py"] != fixed["tinystats/core.py"]
        and "test_mean(" not in snapshot["tests/test_core.py"]
    )
    write_tree(root / "snapshot", snapshot)
    record = {
        "instance_id": "tinystats__mean-1",
        "repo": "tinystats",
        "base_commit": "",
        "patch": make_patch(
            {"tinystats/core.py": snapshot["tinystats/core.py"]}, {"tinystats/core.py": fixed["tinystats/core.py"]}
        ),
        "test_patch": make_patch(
            {"tests/test_core.py": snapshot["tests/test_core.py"]}, {"tests/test_core.py": fixed["tests/test_core.py"]}
        ),
        "problem_statement": "mean() of [3, 1, 4, 1, 5] returns 2.333..., expected 2.8.",
        "FAIL_TO_PASS": json.dumps(FAIL_TO_PASS),  # as SWE-bench stores it
        "PASS_TO_PASS": PASS_TO_PASS,
        "repo_path": "snapshot",
        "test_command": "python -m pytest",
    }
    if env is not None:
        record["env_path"] = str(env)
    path = root / "instances.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def swe_env_dir(tmp_path_factory):
    """pytest and its requirements, copied from this interpreter (same Python version only)."""
    if sandbox_python_version(SANDBOX_PYTHON) != sys.version_info[:2]:
        pytest.skip("the sandbox's python is another version than this one: no offline pytest for it")
    return copy_installed(tmp_path_factory.mktemp("swe-env") / "env", ["pytest"], SANDBOX_PYTHON)


@pytest.fixture(scope="module")
def instance_file(tmp_path_factory, swe_env_dir):
    return build_instance(tmp_path_factory.mktemp("swe-set"), swe_env_dir)


@pytest.fixture(scope="module")
def instance(instance_file):
    return load_instances(instance_file)[0]


def swebench_resolved(outcomes: dict[str, Outcome], f2p: list[str], p2p: list[str]) -> bool:
    """SWE-bench's harness rule, written from its definition: a test passed when its status is
    PASSED or XFAIL, failed when it is absent or FAILED or ERROR; each list's rate is
    passed / (passed + failed) (1 when nothing counts); resolved when both rates are 1."""
    status_map = {
        Outcome.PASSED: "PASSED",
        Outcome.FAILED: "FAILED",
        Outcome.ERROR: "ERROR",
        Outcome.SKIPPED: "SKIPPED",
    }
    sm = {test: status_map[o] for test, o in outcomes.items() if o in status_map}

    def rate(tests):
        passed = sum(1 for t in tests if t in sm and sm[t] in ("PASSED", "XFAIL"))
        failed = sum(1 for t in tests if t not in sm or sm[t] in ("FAILED", "ERROR"))
        return 1.0 if passed + failed == 0 else passed / (passed + failed)

    return rate(f2p) == 1.0 and rate(p2p) == 1.0


@contextmanager
def swe_environment(
    instance: SweInstance, limits: SandboxLimits, grade_limits: SandboxLimits
) -> Iterator[SweEnvironment]:
    """The swe environment over `instance` alone (train and eval), four sessions; the host is
    checked clean after it closes."""
    before = host_state()
    task = SweTask(instance.instance_id, prompt_of(instance), instance)
    sandbox = BwrapSandbox(limits, slot_uid_base=SLOT_UID_BASE, max_concurrency=4)
    environment = SweEnvironment(
        sandbox, {"train": [task], "eval": [task]}, limits, grade_limits, max_turns=12, sessions=4
    )
    try:
        yield environment
    finally:
        environment.close()
    assert_host_clean(before)
