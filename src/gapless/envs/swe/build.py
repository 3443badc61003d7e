"""`gapless swe build`: a task set of injected bugs from real packages, validated by their own tests.

Per package (sources.py fetches it):

    dependency tree  OUT/envs/LABEL: pytest and the declared test requirements (depenv.py)
    baseline         the suite twice in the sandbox; tests passing both times are the stable set
    mutations        every single-site mutation of the package's source (mutate.py), in an
                     order fixed by the seed; tried `jobs` at a time, each a sandbox job running
                     the stable set only, under a timeout derived from the baseline's time
    verdict          kept when some stable tests fail and fewer than `max_fail_frac` of them
                     (FAIL_TO_PASS), the rest passing (PASS_TO_PASS); otherwise rejected with a
                     reason: no_test_fails, too_many_fail, timeout, crashed, unhideable_tests
    instance         OUT/repos/ID: the buggy tree without the failing tests (files equal to the
                     package's are hard links to OUT/.cache/LABEL/tree: never edit a snapshot in
                     place), its `patch` (the reverse diff), `test_patch` (the tests back), a
                     problem statement from the failures (hide.py)

Out: OUT/instances.jsonl (`SweInstance.to_json`, paths relative to OUT) and OUT/build_report.json
(per package: tests, candidates, tried, kept, rejected by reason, seconds).

Guaranteed: the same packages, seed and options give the same instances (the kept set is the
first `max_per_package` valid mutations in the seeded order, whatever order the parallel runs
end in); each verdict is cached under OUT/.cache by the mutant's content and the test context, so
a rerun runs no test it has run (an infra_error is never cached). NOT guaranteed: that a test
which passed twice is never flaky, or that a kept mutation is not also reachable by another fix
(the grader runs tests; it never compares patches).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from packaging.requirements import Requirement

from gapless.envs.swe import depenv
from gapless.envs.swe.hide import hide_tests, problem_statement, unified_diff
from gapless.envs.swe.instances import SweInstance
from gapless.envs.swe.mutate import Mutation, mutations, ordered, parses
from gapless.envs.swe.sources import Source, fetch
from gapless.envs.swe.testrun import RUNNER_SOURCE, Outcome, run_tests
from gapless.envs.swe.verdicts import Verdict, VerdictCache, judge
from gapless.sandbox import SandboxLimits

logger = logging.getLogger(__name__)

PYTEST_REQUIREMENT = "pytest==8.3.5"  # the test runner every built dependency tree gets
TEST_COMMAND = "python -m pytest -o addopts="  # a package's addopts may name plugins it has not got


@dataclass(frozen=True)
class BuildOptions:
    packages: tuple[str, ...]  # NAME==VERSION, or a local sdist or folder
    out: Path
    seed: int = 0
    max_per_package: int = 20
    jobs: int = 2
    max_tries_per_package: int = 200  # mutations tried at most per package
    max_fail_frac: float = 0.5  # a mutation failing more of the stable tests is rejected
    python: str = "/usr/bin/python3"  # the sandbox's interpreter
    offline_env: bool = False  # copy pytest and the requirements from this interpreter (no index)
    slot_uid_base: int = 200000
    memory_mb: int = 2048


@dataclass
class PackageReport:
    package: str
    stable_tests: int = 0
    candidates: int = 0
    tried: int = 0
    kept: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


def build(options: BuildOptions, sandbox=None) -> list[PackageReport]:
    """Build the set into `options.out` (module docstring); returns the per-package reports."""
    from gapless.sandbox import BwrapSandbox

    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    own = sandbox is None
    if own:
        sandbox = BwrapSandbox(python=options.python, slot_uid_base=options.slot_uid_base,
                               max_concurrency=options.jobs)  # fmt: skip
    instances: list[SweInstance] = []
    reports = []
    try:
        for spec in dict.fromkeys(options.packages):  # a package named twice is built once
            started = time.monotonic()
            report = PackageReport(spec)
            try:
                source = fetch(spec, out / ".cache")
                report.package = source.label
                instances += _build_package(source, options, out, sandbox, report)
            except Exception as exc:  # noqa: BLE001 - one package's failure is its report's, the build goes on
                report.error = f"{type(exc).__name__}: {exc}"[:1000]
                logger.warning("swe build: %s failed: %s", spec, report.error)
            report.seconds = round(time.monotonic() - started, 2)
            reports.append(report)
    finally:
        if own:
            sandbox.close()
    kept = {instance.repo_path.name for instance in instances}
    for stale in sorted((out / "repos").glob("*")) if (out / "repos").is_dir() else ():
        if stale.name not in kept:  # a snapshot of an earlier build's instance: not in this set
            shutil.rmtree(stale)
    lines = [json.dumps(instance.to_json(relative_to=out), sort_keys=True) for instance in instances]
    _write_atomic(out / "instances.jsonl", "".join(line + "\n" for line in lines))
    summary = {
        "seed": options.seed,
        "packages": [vars(r) for r in reports],
        "instances": len(instances),
        "seconds": round(sum(r.seconds for r in reports), 2),
    }
    _write_atomic(out / "build_report.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return reports


def _build_package(source: Source, options: BuildOptions, out: Path, sandbox, report: PackageReport):
    cache = out / ".cache" / source.label
    base = _write_base(source, cache / "tree")
    env = _ensure_env(source, out / "envs" / source.label, options)
    stable, baseline_s = _baseline(source, env, sandbox, cache, options)
    report.stable_tests = len(stable)
    if not stable:
        raise RuntimeError(f"no test of {source.label} passes in the sandbox (see {cache / 'baseline.json'})")
    candidates = ordered(
        [m for path in source.source_files for m in mutations(path, source.files[path])],
        f"{options.seed}:{source.label}",
    )
    report.candidates = len(candidates)
    timeout_s = min(max(3 * baseline_s + 10.0, 20.0), 300.0)
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=options.memory_mb, tmp_size_mb=256, max_files=20000)
    context = hashlib.sha256(
        json.dumps([stable, timeout_s, TEST_COMMAND, options.max_fail_frac]).encode() + RUNNER_SOURCE
    ).hexdigest()[:12]
    verdicts = VerdictCache(cache / f"verdicts-{context}.jsonl")
    budget = list(islice((m for m in candidates if parses(m, source.files[m.path])), options.max_tries_per_package))
    built: list[SweInstance] = []
    batch_size = max(1, 2 * options.jobs)
    with ThreadPoolExecutor(max_workers=options.jobs, thread_name_prefix="swe-build") as pool:
        for at in range(0, len(budget), batch_size):
            batch = budget[at : at + batch_size]
            results = list(pool.map(lambda m: _verdict(m, source, env, stable, sandbox, limits, verdicts, options),
                                    batch))  # fmt: skip
            for offset, (mutation, verdict) in enumerate(zip(batch, results)):
                if len(built) >= options.max_per_package:
                    break
                report.tried += 1
                if verdict.reason == "kept":
                    rank = at + offset
                    built.append(_instance(source, mutation, verdict, stable, rank, base, env, out))
                else:
                    report.rejected[verdict.reason] = report.rejected.get(verdict.reason, 0) + 1
            if len(built) >= options.max_per_package:
                break
    report.kept = len(built)
    return built


def _verdict(mutation: Mutation, source: Source, env: Path, stable: list[str], sandbox, limits: SandboxLimits,
             verdicts: VerdictCache, options: BuildOptions) -> Verdict:  # fmt: skip
    cached = verdicts.get(mutation.key)
    if cached is not None:
        return cached
    files = dict(source.files)
    files[mutation.path] = mutation.apply(source.files[mutation.path])
    run = run_tests(sandbox, files, stable, env, limits, TEST_COMMAND)
    verdict = judge(run, stable, options.max_fail_frac)
    if verdict.reason == "kept" and hide_tests(source.files, verdict.failing) is None:
        verdict = Verdict("unhideable_tests")
    if verdict.reason != "infra_error":
        verdicts.put(mutation.key, verdict)
    return verdict


def _instance(source: Source, mutation: Mutation, verdict: Verdict, stable: list[str], rank: int, base: Path,
              env: Path, out: Path) -> SweInstance:  # fmt: skip
    instance_id = f"{source.label}__mut-{rank:04d}"
    hidden = hide_tests(source.files, verdict.failing) or {}
    buggy = mutation.apply(source.files[mutation.path])
    agent_files = {**source.files, mutation.path: buggy, **hidden}
    snapshot = out / "repos" / instance_id
    shutil.rmtree(snapshot, ignore_errors=True)
    for path, content in agent_files.items():
        target = snapshot / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if content is source.files.get(path):
            os.link(base / path, target)
        else:
            target.write_bytes(content)
    failing = set(verdict.failing)
    return SweInstance(
        instance_id=instance_id,
        repo=source.name,
        base_commit=f"{source.name}=={source.version}",
        patch=unified_diff(mutation.path, buggy, source.files[mutation.path]),
        test_patch="".join(unified_diff(path, hidden[path], source.files[path]) for path in sorted(hidden)),
        problem_statement=problem_statement(source.name, verdict.failing, verdict.messages),
        fail_to_pass=verdict.failing,
        pass_to_pass=tuple(t for t in stable if t not in failing),
        repo_path=snapshot,
        env_path=env,
        test_command=TEST_COMMAND,
    )


def _write_base(source: Source, tree: Path) -> Path:
    """The package's files once, under the cache: the snapshots' unchanged files link here."""
    stamp = tree / ".gapless-tree"
    digest = hashlib.sha256(json.dumps(sorted((p, hashlib.sha256(c).hexdigest()) for p, c in source.files.items()))
                            .encode()).hexdigest()  # fmt: skip
    if stamp.is_file() and stamp.read_text() == digest:
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    for path, content in source.files.items():
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(0o444)  # linked into every snapshot: read-only there too
    stamp.write_text(digest)
    return tree


def _ensure_env(source: Source, dest: Path, options: BuildOptions) -> Path:
    wanted = [PYTEST_REQUIREMENT, *source.requirements]
    stamp = dest / ".gapless-env.json"
    record = json.dumps({"requirements": wanted, "python": options.python, "offline": options.offline_env})
    if stamp.is_file() and stamp.read_text() == record:
        return dest
    if options.offline_env:
        names = ["pytest", *(Requirement(r).name for r in source.requirements)]
        depenv.copy_installed(dest, names, options.python)
    else:
        depenv.pip_install(dest, wanted, options.python)
    stamp.write_text(record)
    return dest


def _baseline(source: Source, env: Path, sandbox, cache: Path, options: BuildOptions) -> tuple[list[str], float]:
    """The tests that pass in two runs of the suite, and the slower run's wall time (cached)."""
    key = hashlib.sha256(
        json.dumps([sorted(source.test_files), TEST_COMMAND, str(env)]).encode()
        + RUNNER_SOURCE
        + (cache / "tree" / ".gapless-tree").read_bytes()
        + (env / ".gapless-env.json").read_bytes()
    ).hexdigest()[:12]
    path = cache / "baseline.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["stable"], saved["wall_s"]
    limits = SandboxLimits(timeout_s=600.0, memory_mb=options.memory_mb, tmp_size_mb=256, max_files=20000)
    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent jobs, at once
        runs = list(pool.map(lambda _: run_tests(sandbox, source.files, None, env, limits, TEST_COMMAND,
                                                 suite_paths=source.test_files), range(2)))  # fmt: skip
    passed = [set(run.with_outcome(Outcome.PASSED)) if run.tampered is None else set() for run in runs]
    stable = sorted(passed[0] & passed[1])
    wall_s = max(run.wall_s for run in runs)
    record = {"key": key, "stable": stable, "wall_s": wall_s, "status": [run.status.value for run in runs],
              "outcomes": {t: o.value for t, o in runs[0].outcomes.items()}, "output": runs[0].output[-4000:]}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(record, indent=1, sort_keys=True))
    return stable, wall_s


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
