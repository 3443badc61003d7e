"""envs/swe/testrun.py: pytest in a sandbox job over a real (tiny) repository, typed outcomes, and the
report's defences against the repository's own code (one hostile property per test)."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys

import pytest
from sandbox_host import SLOT_UID_BASE, assert_host_clean, host_state, needs_bwrap
from swe_fixture import TINY_PACKAGE, TINY_PASSING, write_tree

from gapless.envs.swe.depenv import copy_installed, sandbox_python_version
from gapless.envs.swe.testrun import Outcome, load_tree, parse_report, run_tests
from gapless.sandbox import BwrapSandbox, SandboxLimits, Status

SANDBOX_PYTHON = "/usr/bin/python3"
LIMITS = SandboxLimits(timeout_s=60.0, memory_mb=1024, tmp_size_mb=64)
pytestmark = needs_bwrap


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """pytest and its requirements, copied from this interpreter (same Python version only)."""
    if sandbox_python_version(SANDBOX_PYTHON) != sys.version_info[:2]:
        pytest.skip("the sandbox's python is another version than this one: no offline pytest for it")
    return copy_installed(tmp_path_factory.mktemp("swe") / "env", ["pytest"], SANDBOX_PYTHON)


@pytest.fixture(scope="module")
def box():
    before = host_state()
    sandbox = BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=2)
    try:
        yield sandbox
    finally:
        sandbox.close()
    assert_host_clean(before)


def tree(**extra: str) -> dict[str, bytes]:
    return {name: text.encode() for name, text in {**TINY_PACKAGE, **extra}.items()}


def test_whole_suite_passes_from_a_directory(box, env, tmp_path):
    repo = write_tree(tmp_path / "repo", TINY_PACKAGE)
    run = run_tests(box, repo, None, env, LIMITS)
    assert run.status is Status.OK and run.is_complete and run.tampered is None, run.output
    assert run.exit_code == 0
    assert len(run.outcomes) == TINY_PASSING and set(run.outcomes.values()) == {Outcome.PASSED}
    assert "tests/test_core.py::test_chunks[2-expected0]" in run.outcomes


def test_selection_gives_every_outcome(box, env):
    extra = """\
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture exploded")

def test_fails():
    assert 1 + 1 == 3, "arithmetic is off"

def test_errors(broken):
    pass

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass

@pytest.mark.xfail(strict=True)
def test_xfail():
    assert False
"""
    ids = [
        "tests/test_core.py::test_mean",
        "tests/test_extra.py::test_fails",
        "tests/test_extra.py::test_errors",
        "tests/test_extra.py::test_skipped",
        "tests/test_extra.py::test_xfail",
        "tests/test_extra.py::test_not_there",
        "tests/test_gone.py::test_x",
    ]
    run = run_tests(box, tree(**{"tests/test_extra.py": extra}), ids, env, LIMITS)
    assert run.status is Status.OK and run.tampered is None, run.output
    assert run.outcomes == {
        ids[0]: Outcome.PASSED,
        ids[1]: Outcome.FAILED,
        ids[2]: Outcome.ERROR,
        ids[3]: Outcome.SKIPPED,
        ids[4]: Outcome.SKIPPED,
        ids[5]: Outcome.MISSING,
        ids[6]: Outcome.MISSING,
    }
    assert run.collected == 5  # only the requested tests ran
    assert "arithmetic is off" in run.messages[ids[1]] and "fixture exploded" in run.messages[ids[2]]


def test_a_module_that_does_not_import_makes_its_tests_errors(box, env):
    ids = ["tests/test_core.py::test_mean", "tests/test_core.py::test_clamp_low"]
    broken = tree(**{"tinystats/core.py": TINY_PACKAGE["tinystats/core.py"] + "\nimport no_such_module\n"})
    run = run_tests(box, broken, ids, env, LIMITS)
    assert run.outcomes == dict.fromkeys(ids, Outcome.ERROR)
    assert "no_such_module" in run.messages[ids[0]]


def test_a_hanging_test_keeps_the_finished_ones(box, env):
    hang = "import time\n\ndef test_a():\n    pass\n\ndef test_b():\n    time.sleep(600)\n\ndef test_c():\n    pass\n"
    ids = ["tests/test_hang.py::test_a", "tests/test_hang.py::test_b", "tests/test_hang.py::test_c"]
    limits = SandboxLimits(timeout_s=15.0)  # room for a loaded host to finish test_a
    run = run_tests(box, tree(**{"tests/test_hang.py": hang}), ids, env, limits)
    assert run.status is Status.TIMEOUT and not run.is_complete
    assert run.outcomes == {ids[0]: Outcome.PASSED, ids[1]: Outcome.MISSING, ids[2]: Outcome.MISSING}


def test_src_layout_and_tarball(box, env, tmp_path):
    import tarfile

    files = {("src/" + k if k.startswith("tinystats/") else k): v for k, v in TINY_PACKAGE.items()}
    write_tree(tmp_path / "tinystats-0.1.0", files)
    archive = tmp_path / "repo.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "tinystats-0.1.0", arcname="tinystats-0.1.0")
    assert "src/tinystats/core.py" in load_tree(archive)
    run = run_tests(box, archive, ["tests/test_text.py::test_count_vowels"], env, LIMITS)
    assert run.outcomes == {"tests/test_text.py::test_count_vowels": Outcome.PASSED}, run.output


# -- the repository's code against the report ------------------------------------------------------

FORGE_HOOK = """\
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
"""
FAILING = {"tests/test_core.py": TINY_PACKAGE["tests/test_core.py"].replace("== 2.8", "== 99")}


def test_a_conftest_that_forges_outcomes_is_tampering(box, env):
    files = tree(**FAILING, **{"tests/conftest.py": TINY_PACKAGE["tests/conftest.py"] + FORGE_HOOK})
    test_id = "tests/test_core.py::test_mean"
    trusted = run_tests(box, files, [test_id], env, LIMITS)  # the caller vouched for every conftest.py
    assert trusted.outcomes[test_id] is Outcome.PASSED  # so the forgery works: graders restore them
    run = run_tests(box, files, [test_id], env, LIMITS, hook_files=[])
    assert run.tampered and "pytest_runtest_makereport" in run.tampered
    assert not run.is_passed(test_id) and run.outcomes[test_id] is Outcome.ERROR


def test_package_code_that_patches_the_runner_is_tampering(box, env):
    patch = "\nimport _pytest.runner\n_pytest.runner.call_and_report = lambda item, when, log=True, **kw: None\n"
    files = tree(**FAILING, **{"tinystats/core.py": TINY_PACKAGE["tinystats/core.py"] + patch})
    run = run_tests(box, files, ["tests/test_core.py::test_mean"], env, LIMITS)
    assert run.tampered == "runner.call_and_report was replaced"
    assert not run.is_passed("tests/test_core.py::test_mean")


def test_a_test_writing_to_the_report_pipe_is_tampering(box, env):
    forge = 'import os\n\ndef test_forge():\n    os.write(3, b"garbage\\n")\n    assert False\n'
    run = run_tests(box, tree(**{"tests/test_forge.py": forge}), ["tests/test_forge.py::test_forge"], env, LIMITS)
    assert run.tampered == "a malformed or unsigned report line"
    assert not run.is_passed("tests/test_forge.py::test_forge")


def test_planted_pytest_dist_info_pth_and_sitecustomize_do_nothing(box, env):
    evil = "raise SystemExit('planted code ran')\n"
    planted = {
        "pytest.py": evil,
        "_pytest/__init__.py": evil,
        "pluggy.py": evil,
        "sitecustomize.py": evil,
        "usercustomize.py": evil,
        "evil.pth": "import sys; sys.exit('pth ran')\n",
        "evil_plugin.py": evil,
        "evil-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
        "evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil_plugin\n",
    }
    run = run_tests(box, tree(**planted), ["tests/test_text.py::test_title_words"], env, LIMITS)
    assert run.status is Status.OK and run.tampered is None, run.output
    assert run.outcomes == {"tests/test_text.py::test_title_words": Outcome.PASSED}


def _signed(key: bytes, *records: dict) -> bytes:
    """A report as the runner writes it: the key line, then `MAC JSON` per record."""
    lines = [json.dumps({"key": key.hex()})]
    for record in records:
        body = json.dumps(record)
        lines.append(hmac.new(key, body.encode(), hashlib.sha256).hexdigest() + " " + body)
    return ("\n".join(lines) + "\n").encode()


def test_parse_report_never_raises_and_never_passes_junk():
    wanted, key, passed, end = (
        ["a.py::t"],
        bytes(range(32)),
        {"t": "a.py::t", "o": "passed"},
        {"end": 0, "tamper": None},
    )
    assert parse_report(_signed(key, passed, end), wanted, Status.OK).is_passed("a.py::t")  # the control
    for junk in (b"", b"\xff\xfe", b"[1]\n", b'{"t": "a.py::t", "o": "won"}\n', b'{"end": "x"}\n' * 3):
        run = parse_report(junk, wanted, Status.OK)
        assert not run.is_passed("a.py::t")
    assert parse_report(_signed(key, passed, passed, end), wanted, Status.OK).tampered == "a.py::t reported twice"
    assert not parse_report(_signed(key, end, passed), wanted, Status.OK).is_passed("a.py::t")
    unsigned = _signed(key).decode() + json.dumps(passed) + "\n" + json.dumps(end) + "\n"
    assert parse_report(unsigned.encode(), wanted, Status.OK).tampered == "a malformed or unsigned report line"
    other_key = _signed(key) + _signed(bytes(32), passed, end).split(b"\n", 1)[1]  # lines signed with another key
    assert not parse_report(other_key, wanted, Status.OK).is_passed("a.py::t")
    no_key = _signed(key, passed, end).split(b"\n", 1)[1]
    assert parse_report(no_key, wanted, Status.OK).tampered == "the report does not start with the runner's key"
