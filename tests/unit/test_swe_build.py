"""envs/swe/build.py end to end on a tiny local package (no network): instances load, every one is
valid by the SWE-bench rule when re-run in the sandbox, the build is deterministic and cached."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from sandbox_host import SLOT_UID_BASE, assert_host_clean, host_state, needs_bwrap
from swe_fixture import TINY_PACKAGE, write_tree

from gapless.envs.swe.build import BuildOptions, build
from gapless.envs.swe.depenv import sandbox_python_version
from gapless.envs.swe.instances import load_instances
from gapless.envs.swe.testrun import load_tree, run_tests
from gapless.sandbox import BwrapSandbox, SandboxLimits

pytestmark = needs_bwrap
LIMITS = SandboxLimits(timeout_s=60.0, memory_mb=1024)


@pytest.fixture(scope="module")
def box():
    if sandbox_python_version("/usr/bin/python3") != sys.version_info[:2]:
        pytest.skip("the sandbox's python is another version than this one: no offline pytest for it")
    before = host_state()
    sandbox = BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=2)
    try:
        yield sandbox
    finally:
        sandbox.close()
    assert_host_clean(before)


def options(package, out, jobs: int = 2) -> BuildOptions:
    return BuildOptions(packages=(str(package),), out=out, seed=3, max_per_package=3, jobs=jobs,
                        max_tries_per_package=12, offline_env=True)  # fmt: skip


@pytest.fixture(scope="module")
def built(box, tmp_path_factory):
    root = tmp_path_factory.mktemp("swe-build")
    package = write_tree(root / "tinystats-0.1.0", TINY_PACKAGE)
    reports = build(options(package, root / "out"), box)
    return package, root / "out", reports


def test_build_reports_counts_and_writes_loadable_instances(built):
    _, out, reports = built
    (report,) = reports
    assert report.error is None and report.package == "tinystats-0.1.0"
    assert report.stable_tests == 13 and report.kept == 3
    assert report.tried == report.kept + sum(report.rejected.values())
    summary = json.loads((out / "build_report.json").read_text())
    assert summary["instances"] == 3 and summary["packages"][0]["kept"] == 3
    instances = load_instances(out / "instances.jsonl")
    assert len(instances) == 3
    for instance in instances:
        assert instance.fail_to_pass and not set(instance.fail_to_pass) & set(instance.pass_to_pass)
        assert len(instance.fail_to_pass) + len(instance.pass_to_pass) == 13
        assert instance.env_path is not None and (instance.env_path / "pytest").is_dir()
        name = instance.fail_to_pass[0].split("::")[-1].split("[")[0]
        assert name in instance.problem_statement
        snapshot = load_tree(instance.repo_path)
        assert not any(f"def {name}(".encode() in text for path, text in snapshot.items() if path.startswith("tests/"))


def test_every_instance_is_valid_by_the_swe_bench_rule(built, box, tmp_path):
    package, out, _ = built
    for instance in load_instances(out / "instances.jsonl"):
        work = tmp_path / instance.instance_id
        shutil.copytree(instance.repo_path, work)
        (work / "t.diff").write_text(instance.test_patch)
        subprocess.run(["git", "apply", "t.diff"], cwd=work, check=True)
        (work / "t.diff").unlink()
        ids = [*instance.fail_to_pass, *instance.pass_to_pass]
        unfixed = run_tests(box, work, ids, instance.env_path, LIMITS, instance.test_command)
        assert all(not unfixed.is_passed(t) for t in instance.fail_to_pass), instance.instance_id
        assert all(unfixed.is_passed(t) for t in instance.pass_to_pass), instance.instance_id
        (work / "p.diff").write_text(instance.patch)
        subprocess.run(["git", "apply", "p.diff"], cwd=work, check=True)
        (work / "p.diff").unlink()
        assert load_tree(work) == load_tree(package)  # the reference fix and the tests give the package back
        fixed = run_tests(box, work, ids, instance.env_path, LIMITS, instance.test_command)
        assert all(fixed.is_passed(t) for t in ids), instance.instance_id


def test_rebuild_is_cached_and_another_job_count_gives_the_same_set(built, box, tmp_path):
    package, out, _ = built
    first = (out / "instances.jsonl").read_text()
    started = time.monotonic()
    build(options(package, out), box)
    assert time.monotonic() - started < 3.0  # every verdict and the baseline come from the cache
    assert (out / "instances.jsonl").read_text() == first
    other = tmp_path / "other"
    build(options(package, other, jobs=1), box)
    assert (other / "instances.jsonl").read_text() == first  # paths are relative to each set's folder


def test_cli_names_what_is_missing(capsys):
    from gapless.cli import main

    assert main(["swe", "build", "--out", "somewhere"]) == 2
    assert "--packages NAME==VERSION" in capsys.readouterr().err
    assert main(["swe", "build", "--packages", "x==1", "--out", "o", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
