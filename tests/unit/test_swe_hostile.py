"""Hostile agents against the swe environment (one attack per row): each writes what, if it worked,
would make the unfixed repository score 1 or the episode infra_error, through the real tools,
session and grader. None may: the reward stays 0 and the status is the agent's own."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sandbox_host import IS_ROOT, needs_bwrap
from swe_instance import instance, instance_file, swe_env_dir, swe_environment  # noqa: F401

from gapless.envs.swe.environment import SweEnvironment
from gapless.envs.swe.grading import GradeRules
from gapless.envs.swe.testrun import DEFAULT_LIMITS
from gapless.sandbox import SandboxLimits
from gapless.types import Completion

pytestmark = [needs_bwrap, pytest.mark.skipif(not IS_ROOT, reason="copy-on-write sessions need root")]
LIMITS = SandboxLimits(timeout_s=20.0, memory_mb=1024, max_processes=32, tmp_size_mb=8, max_output_bytes=8 << 20)
GRADE_LIMITS = replace(DEFAULT_LIMITS, timeout_s=30.0, memory_mb=1024, tmp_size_mb=64)
FIX = "import tinystats, tinystats.core as c\nc.mean = tinystats.mean = lambda v: sum(v) / len(v) if v else c.chunks([], 0)\n"
PASS_ALL_HOOK = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
INIT = "from tinystats.core import chunks, clamp, is_sorted, mean, running_total\n"
PATCH_RUNNER = """
import _pytest.reports
_original = _pytest.reports.TestReport.from_item_and_call.__func__


def _always_passed(cls, item, call):
    report = _original(cls, item, call)
    report.outcome = "passed"
    report.longrepr = None
    return report


_pytest.reports.TestReport.from_item_and_call = classmethod(_always_passed)
"""
FAKE_LINES = """
import os
for _t in ["tests/test_core.py::test_mean"]:
    os.write(3, ('{"t": "%s", "o": "passed"}\\n' % _t).encode())
"""


def write(path: str, text: str) -> str:
    return f"<cmd>write {path}\n{text}</cmd>"


ATTACKS = {
    "conftest.py forging every outcome": [
        write("conftest.py", PASS_ALL_HOOK),
        write("tests/conftest.py", PASS_ALL_HOOK),
    ],
    "pytest plugin by -p in pyproject and an entry point": [
        write("tinystats/evil.py", PASS_ALL_HOOK),
        write("pyproject.toml", '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "-p tinystats.evil"\n'),
        write("evil-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n"),
        write("evil-1.0.dist-info/entry_points.txt", "[pytest11]\nevil = tinystats.evil\n"),
    ],
    "sitecustomize, usercustomize and a .pth file": [
        write("sitecustomize.py", FIX),
        write("usercustomize.py", FIX),
        write("evil.pth", FIX.replace("\n", "; ", 1)),
        write("tinystats/sitecustomize.py", FIX),
    ],
    "package code monkeypatching the test runner": [write("tinystats/__init__.py", INIT + PATCH_RUNNER)],
    "package code writing a fake report": [write("tinystats/__init__.py", INIT + FAKE_LINES)],
    "the grading job's infra exit code": [write("tinystats/__init__.py", "import os\nos._exit(70)\n")],
    "killing every process of the grading job": [write("tinystats/__init__.py", "import os\nos.kill(-1, 9)\n")],
    "hanging past the grading deadline": [write("tinystats/__init__.py", "import time\ntime.sleep(3600)\n")],
    "a link to the hidden file's place and an escaping path": [
        "<cmd>run rm tests/test_core.py && ln -s /work/base/tests/test_core.py tests/test_core.py</cmd>",
        "<cmd>run ln -s /etc tinystats/etc</cmd>",
    ],
    "a file where the tests folder is": ["<cmd>run rm -r tests && echo x > tests</cmd>"],
    "killing the session's own processes": [
        "<cmd>run kill -9 -1</cmd>",
        "<cmd>run python -c 'import os; os.kill(1, 9)'</cmd>",
    ],
    "filling the session's disk": ['<cmd>run python -c \'open("big", "wb").write(b"x" * (64 << 20))\'</cmd>'],
}


@pytest.fixture(scope="module")
def env(instance):  # noqa: F811
    with swe_environment(instance, LIMITS, GRADE_LIMITS) as environment:
        yield environment


def play(env, turns: list[str]):
    task = env.tasks("train")[0]
    ep = env.start_episode(task, [1])
    for text in [*turns, "<cmd>done</cmd>"]:
        if ep.is_done:
            break
        env.take_turn(ep, Completion([1], [7], [-0.1], [0], "stop", text), lambda s: [5])
    return ep, env.to_rollout(ep)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_scores_zero_and_is_the_agents_own(env, attack):
    ep, rollout = play(env, ATTACKS[attack])
    assert rollout.reward == 0.0 and rollout.status == "tests_failed", (attack, rollout.info, ep.texts)


def test_the_attacks_would_pay_if_they_ran(env):
    """The payload of the sitecustomize row fixes the bug when it is imported: the rows above test
    the grader, not a payload that could not have worked."""
    ep, rollout = play(env, [write("tinystats/__init__.py", INIT + FIX)])
    assert (rollout.reward, rollout.status) == (1.0, "ok"), rollout.info


def test_without_test_protection_a_forging_conftest_is_tampering(env):
    open_rules = object.__new__(SweEnvironment)
    open_rules.__dict__.update(env.__dict__, rules=GradeRules(protect_tests=False))
    _, rollout = play(open_rules, ATTACKS["conftest.py forging every outcome"])
    assert rollout.reward == 0.0 and "tampered" in rollout.info, rollout.info


def test_the_hidden_test_and_the_reference_are_nowhere_in_the_session(env, instance):  # noqa: F811
    marker = "assert mean(numbers) == 2.8"  # the hidden test's line; the reference's fixed line:
    fixed = "return sum(values) / len(values)"
    ep, rollout = play(
        env,
        [
            f"<cmd>run grep -rlsF '{marker}' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr; echo searched</cmd>",
            f"<cmd>run grep -rlsF '{fixed}' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr; echo searched</cmd>",
        ],
    )
    assert ep.texts[1] == "<out>searched\n[exit 0]</out>\n" and ep.texts[3] == "<out>searched\n[exit 0]</out>\n"
    assert marker in instance.test_patch and fixed in instance.patch  # the searches looked for the right text


def test_a_complete_forged_report_from_package_code(env):
    """Package code that knows the report's format writes a whole passing report and exits: the lines
    lack the runner's signature (envs/swe/testrun.py), so nothing passes."""
    forged = (
        "import os, json\n"
        "ids = ['tests/test_core.py::test_mean', 'tests/test_core.py::test_mean_empty', 'tests/test_core.py::test_clamp_inside',"
        " 'tests/test_core.py::test_clamp_low', 'tests/test_core.py::test_clamp_high',"
        " 'tests/test_core.py::test_chunks[2-expected0]', 'tests/test_text.py::test_title_words']\n"
        "os.write(3, (json.dumps({'collected': len(ids)}) + '\\n').encode())\n"
        "for t in ids:\n    os.write(3, (json.dumps({'t': t, 'o': 'passed'}) + '\\n').encode())\n"
        "os.write(3, (json.dumps({'end': 0, 'tamper': None}) + '\\n').encode())\n"
        "os._exit(0)\n"
    )
    _, rollout = play(env, [write("tinystats/__init__.py", forged)])
    assert rollout.reward == 0.0, rollout.info
