"""The verdict on one mutation: kept as an instance, or rejected and why; and their cache.

`judge(run, stable, max_fail_frac)` reads the run of the stable tests on a mutant: kept when some
of them fail and at most `max_fail_frac` of them (the failing ones are FAIL_TO_PASS, the rest
PASS_TO_PASS); otherwise the reason, one of `REASONS`. `VerdictCache` keeps verdicts by mutation
key in a JSON-lines file, appended as they come, so an interrupted build loses at most a line.

Guaranteed: a test counts as passing only on the report's word (`TestRun.is_passed`), so a
mutant whose run crashed or timed out is never kept; infra_error is a verdict the caller must
not cache (the sandbox failed, not the mutant).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from gapless.envs.swe.testrun import TestRun
from gapless.sandbox import Status

REASONS = ("no_test_fails", "too_many_fail", "timeout", "crashed", "unhideable_tests", "infra_error")


@dataclass(frozen=True)
class Verdict:
    reason: str  # "kept" or why not
    failing: tuple[str, ...] = ()
    messages: dict[str, str] = field(default_factory=dict)


def judge(run: TestRun, stable: Sequence[str], max_fail_frac: float) -> Verdict:
    """Kept, or why not (module docstring)."""
    if run.status is Status.INFRA_ERROR:
        return Verdict("infra_error")
    if run.status is Status.TIMEOUT:
        return Verdict("timeout")
    if run.tampered is not None or not run.is_complete:
        return Verdict("crashed")
    failing = tuple(t for t in stable if not run.is_passed(t))
    if not failing:
        return Verdict("no_test_fails")
    if len(failing) > max_fail_frac * len(stable):
        return Verdict("too_many_fail")
    return Verdict("kept", failing, {t: run.messages.get(t, "") for t in failing[:10]})


class VerdictCache:
    """Verdicts by mutation key, in a JSON-lines file appended as they come (threads share it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.known: dict[str, Verdict] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    self.known[record["key"]] = Verdict(record["reason"], tuple(record["failing"]), record["messages"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by an interrupted build

    def get(self, key: str) -> Verdict | None:
        with self.lock:
            return self.known.get(key)

    def put(self, key: str, verdict: Verdict) -> None:
        record = {"key": key, "reason": verdict.reason, "failing": list(verdict.failing), "messages": verdict.messages}
        with self.lock:
            self.known[key] = verdict
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
