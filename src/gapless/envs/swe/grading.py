"""Grading a SWE episode: the agent's final tree plus the test patch, its tests run in a fresh job.

    snapshot files ──+ agent's changes (changed / deleted files; test-defining files dropped,
                     │  `protect_tests`) ──+ test_patch (restores the hidden tests) ──> tree
    tree ──> testrun.run_tests(FAIL_TO_PASS + PASS_TO_PASS) in a fresh sandbox job ──> outcomes
    outcomes ──> SWE-bench's rule ──> reward

The rule is SWE-bench's harness's (its `get_eval_tests_report` / `get_resolution_status`): a
test *succeeds* when it passed (or xfailed), *fails* when it failed, errored or has no result,
and counts as neither when skipped; an instance is resolved when no FAIL_TO_PASS and no
PASS_TO_PASS test fails. reward = 1 if resolved, else 0. Options, each a documented difference:
- `partial_credit`: reward = the fraction of FAIL_TO_PASS tests that succeed, 0 if any
  PASS_TO_PASS test fails (the resolved instance still scores 1);
- `skip_is_failure`: a skipped test fails (closes a loophole of SWE-bench's rule: code under
  test can skip the very tests that grade it);
- `protect_tests` (default on): the agent's changes to test-defining files are dropped before
  grading (every conftest.py, pytest.ini, tox.ini, setup.cfg, pyproject.toml, files named
  test_*.py or *_test.py, files under a tests/test/testing folder, the files of the graded
  tests and of the test patch), so a policy cannot rewrite the tests or the pytest
  configuration it is graded by. Off: SWE-bench exactly (only the test patch's files are reset).
Also: no reward from an incomplete or tampered report (testrun.py): the runner must have written
its footer and found no patched runner.

Statuses: ok (resolved), tests_failed (reward as above, `info` says which tests failed),
infra_error only when the grading job itself could not run (the sandbox's verdict, after the
pool's retry): never for what the repository's code does in it.
NOT guaranteed: that code in the package cannot forge the report from inside the test process
(testrun.py's limits); that the snapshot's own tests are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Iterable, Mapping

from gapless.envs.swe.instances import SweInstance
from gapless.envs.swe.patches import apply_patch, parse_patch
from gapless.envs.swe.testrun import Outcome, TestRun, run_tests
from gapless.sandbox import SandboxLimits, Status

CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})
TEST_FOLDERS = frozenset({"tests", "test", "testing"})
_FAILED = (Outcome.FAILED, Outcome.ERROR, Outcome.MISSING)


@dataclass(frozen=True)
class Changes:
    """The agent's final tree, as changes against the snapshot (untrusted content)."""

    changed: Mapping[str, bytes]
    deleted: tuple[str, ...] = ()


@dataclass(frozen=True)
class GradeRules:
    partial_credit: bool = False
    skip_is_failure: bool = False
    protect_tests: bool = True


@dataclass(frozen=True)
class Grade:
    reward: float
    status: str  # ok | tests_failed | infra_error
    info: dict


def is_test_defining(path: str, instance: SweInstance) -> bool:
    """Whether `path` decides how or which tests run (module docstring, `protect_tests`)."""
    parts = PurePosixPath(path).parts
    name = parts[-1]
    return (
        name in CONFIG_FILES
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
        or any(part in TEST_FOLDERS for part in parts[:-1])
        or path in _test_files(instance)
    )


def _test_files(instance: SweInstance) -> set[str]:
    files = {test_id.split("::", 1)[0] for test_id in (*instance.fail_to_pass, *instance.pass_to_pass)}
    for patch in parse_patch(instance.test_patch) if instance.test_patch.strip() else ():
        files |= {p for p in (patch.old_path, patch.new_path) if p}
    return files


def grading_tree(
    instance: SweInstance, snapshot: Mapping[str, bytes], changes: Changes, rules: GradeRules
) -> tuple[dict[str, bytes], list[str], list[str]]:
    """(tree, hook files, dropped changes): the snapshot, the kept changes, the test patch."""
    reset = _test_files(instance)
    dropped = sorted(
        p for p in (*changes.changed, *changes.deleted)
        if (is_test_defining(p, instance) if rules.protect_tests else p in reset)
    )  # fmt: skip
    tree = dict(snapshot)
    for path in changes.deleted:
        if path not in dropped:
            tree.pop(path, None)
    tree.update({path: text for path, text in changes.changed.items() if path not in dropped})
    trusted = with_patch(snapshot, instance.test_patch)
    tree = with_patch(tree, instance.test_patch)
    folders = {str(parent) for path in tree for parent in PurePosixPath(path).parents}
    for path in [p for p in tree if p in folders]:  # a file where a folder must be: the agent's, dropped
        del tree[path]
        dropped.append(path)
    hooks = [p for p in tree if PurePosixPath(p).name == "conftest.py" and trusted.get(p) == tree[p]]
    return tree, hooks, dropped


def with_patch(tree: Mapping[str, bytes], patch: str) -> dict[str, bytes]:
    """`tree` with a (trusted) unified diff applied to the files it names."""
    if not patch.strip():
        return dict(tree)
    touched = {p for fp in parse_patch(patch) for p in (fp.old_path, fp.new_path) if p}
    text = {p: tree[p].decode("utf-8", "surrogateescape") for p in touched if p in tree}
    patched = apply_patch(text, patch)
    out = {p: data for p, data in tree.items() if p not in touched}
    out.update({p: t.encode("utf-8", "surrogateescape") for p, t in patched.items()})
    return out


def resolution(run: TestRun, instance: SweInstance, rules: GradeRules) -> tuple[float, dict]:
    """SWE-bench's rule over a run's outcomes (module docstring): (reward, info)."""
    failing = _FAILED + ((Outcome.SKIPPED,) if rules.skip_is_failure else ())
    trustworthy = run.is_complete and run.tampered is None

    def split(ids: Iterable[str]) -> tuple[list[str], list[str]]:
        ids = list(ids)
        failed = [t for t in ids if not trustworthy or run.outcomes.get(t, Outcome.MISSING) in failing]
        succeeded = [t for t in ids if t not in failed and run.outcomes.get(t) is Outcome.PASSED]
        return succeeded, failed

    f2p_ok, f2p_failed = split(instance.fail_to_pass)
    _, p2p_failed = split(instance.pass_to_pass)
    resolved = not f2p_failed and not p2p_failed
    reward = 1.0 if resolved else 0.0
    if rules.partial_credit and not resolved and not p2p_failed:
        counted = len(f2p_ok) + len(f2p_failed)
        reward = len(f2p_ok) / counted if counted else 1.0
    info = {"resolved": resolved, "f2p_failed": f2p_failed[:20], "p2p_failed": p2p_failed[:20],
            "f2p": len(instance.fail_to_pass), "p2p": len(instance.pass_to_pass)}  # fmt: skip
    if run.tampered is not None:
        info["tampered"] = run.tampered[:200]
    if not run.is_complete:
        info["report_incomplete"] = True
    return reward, info


def grade(
    sandbox,
    instance: SweInstance,
    snapshot: Mapping[str, bytes],
    changes: Changes,
    env: Mapping[str, bytes] | None,
    limits: SandboxLimits,
    rules: GradeRules = GradeRules(),
) -> Grade:
    """Run the instance's tests on the agent's tree in a fresh job; a `Grade`, never raises for
    anything the agent did."""
    tree, hooks, dropped = grading_tree(instance, snapshot, changes, rules)
    ids = list(dict.fromkeys((*instance.fail_to_pass, *instance.pass_to_pass)))
    run = run_tests(sandbox, tree, ids, env, limits, instance.test_command, hook_files=hooks)
    if run.status is Status.INFRA_ERROR:
        return Grade(0.0, "infra_error", {"error": run.output[-300:] + " (run `gapless sandbox check`)"})
    reward, info = resolution(run, instance, rules)
    if dropped:
        info["dropped_changes"] = dropped[:20]
    if run.status not in (Status.OK, Status.NONZERO_EXIT):
        info["grade_status"] = run.status.value  # the repository's code did it: scored
    return Grade(reward, "ok" if info["resolved"] else "tests_failed", info)
