"""The masking watch: how many rollouts `infra_error` takes out of training, per prompt and per
policy version, and what happens when a prompt or a version stands out.

Masking is right for a real outage and a way out for a policy otherwise: a masked rollout leaves
its group's statistics, so a policy able to make its failures look like the infrastructure's
would lose nothing by failing (docs/architecture.md, invariant 10). Every rollout source calls
`MaskingWatch.observe` once for each scored group as it arrives, before the group is filed (the
pipeline's buffer drops a group masked whole as 'infra_error': it is counted all the same), so the
synchronous and the asynchronous runs are watched alike.

Cells: one per prompt (its task uid) and one per policy version (the newest version among a
rollout's tokens: the one that finished the program). Each holds n rollouts seen, k masked.

Flag rule, checked for the cells of each arriving group; a cell is flagged when all three hold:

    k >= MIN_MASKED                                   (a few masked rollouts prove nothing)
    k / n > pipeline.max_infra_fraction               (the share the run tolerates)
    P[Binomial(n, p) >= k] < ALPHA,  p = (K - k + 1) / (N - n + 2),  with N - n >= n

where N, K count every rollout of the run so far: p is the masked rate of the rest of the run,
add-one smoothed so that a clean rest is not a rate of 0, and the rest must hold at least as many
rollouts as the cell (the first version of a run has nothing to be compared with). A uniform outage raises
every cell together and flags none (pipeline.outage_s and `check_infra` handle it); a cell masked
far above the rest of the run is flagged. A flag stays for the rest of the run segment. A version
cell does not count the masked rollouts of a flagged prompt as masked (they are that prompt's,
and would otherwise flag every version it was sampled under).

What a flag does (pipeline.on_infra_excess):
    'fail'  every masked rollout of a flagged cell, from the group that raised the flag on, is
            scored as a failure: reward 0, status 'infra_excess' (its `info` keeps the error and
            `masked_status`), counted in `rollout/infra_scored`. Masking then pays no more than failing.
    'stop'  `MaskingExcess` (exit code 3) naming the flagged cells with their counts.

Metrics (`step_metrics`, logged with each step): `rollout/infra_frac` (masked share of the rollouts
that arrived since the previous step), `rollout/infra_frac_run` (of every rollout so far),
`rollout/infra_prompt_frac_max` (the highest masked share of a prompt with at least MIN_MASKED
rollouts), `rollout/infra_flagged_prompts`, `rollout/infra_flagged_versions`, `rollout/infra_scored`.
`write(path)` keeps `masking.json` in the run directory: the counts of every prompt with a masked
rollout, of every version, and each flag with its evidence (read by `gapless report`).

Not guaranteed: masked rollouts that arrived before their cell was flagged stay masked (they were
filed or trained already); masking that rises on every prompt and every version at once looks
like an outage and is not flagged (it shows in `rollout/infra_frac_run`); the other way round, a
real outage confined to one policy version's time looks like that version masking and flags it
(the diagnosis says which); counts start afresh at a resume (one segment's own).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from gapless.errors import InfrastructureError
from gapless.types import Rollout

MIN_MASKED = 4  # masked rollouts a cell needs before it can be flagged
ALPHA = 1e-3  # binomial tail probability below which a cell's share is "far above" the rest's
EXCESS_STATUS = "infra_excess"  # a masked rollout of a flagged cell, scored as a failure

Kind = Literal["prompt", "version"]


class MaskingExcess(InfrastructureError):
    """Prompts or policy versions masked as infra_error far above the run's base rate, with
    pipeline.on_infra_excess = 'stop'."""


@dataclass
class Cell:
    rollouts: int = 0
    masked: int = 0


@dataclass(frozen=True)
class Flag:
    kind: Kind
    key: str  # the prompt uid, or the policy version as text
    rollouts: int
    masked: int
    base_rate: float  # p: the smoothed masked rate of the rest of the run
    p_value: float  # P[Binomial(rollouts, base_rate) >= masked]

    def describe(self) -> str:
        return (
            f"{self.kind} {self.key}: {self.masked} of {self.rollouts} rollouts masked "
            f"({self.masked / self.rollouts:.0%}) against {self.base_rate:.1%} in the rest of the run "
            f"(binomial tail {self.p_value:.1e})"
        )


def binomial_tail(n: int, k: int, p: float) -> float:
    """P[X >= k] for X ~ Binomial(n, p), summed in log space (n in the thousands is fine)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def rollout_version(rollout: Rollout) -> int:
    versions = rollout.completion.versions
    return max(versions) if versions else 0


class MaskingWatch:
    def __init__(self, max_fraction: float, action: Literal["fail", "stop"]):
        self.max_fraction, self.action = max_fraction, action
        self.cells: dict[Kind, dict[str, Cell]] = {"prompt": {}, "version": {}}
        self.total = Cell()
        self.flags: dict[tuple[Kind, str], Flag] = {}
        self.window = Cell()  # since the last step_metrics
        self.scored = 0  # masked rollouts scored as failures since the last step_metrics
        self.scored_total = 0

    def observe(self, uid: str, rollouts: list[Rollout]) -> list[Rollout]:
        """Count one arriving group (prompt `uid`) and apply the flag rule to its cells; returns
        the rollouts to file: the same ones, or with a flagged cell's masked rollouts scored as
        failures. Raises MaskingExcess when a cell is flagged and the action is 'stop'."""
        masked = [r.is_infra_failure for r in rollouts]
        self._count("prompt", uid, len(rollouts), sum(masked))
        for cell in (self.total, self.window):
            cell.rollouts += len(rollouts)
            cell.masked += sum(masked)
        new = [flag] if any(masked) and (flag := self._check("prompt", uid)) is not None else []
        # a flagged prompt's masked rollouts are its own: counted as masked against a version, they
        # would flag every version it was sampled under
        by_prompt = ("prompt", uid) in self.flags
        versions: dict[str, list[int]] = {}
        for rollout, is_masked in zip(rollouts, masked):
            counts = versions.setdefault(str(rollout_version(rollout)), [0, 0])
            counts[0] += 1
            counts[1] += is_masked and not by_prompt
        for version, (n, k) in versions.items():
            self._count("version", version, n, k)
            if k and (flag := self._check("version", version)) is not None:
                new.append(flag)
        if new and self.action == "stop":
            raise MaskingExcess(
                "rollouts came back masked as infra_error far above the run's base rate: "
                + "; ".join(flag.describe() for flag in new)
                + f" (pipeline.max_infra_fraction = {self.max_fraction:g}). A policy must not be able to turn its "
                "failures into masked rollouts: look at these rollouts' errors (groups.jsonl, the environment's "
                "logs) and fix what the environment attributes to the infrastructure, or set "
                "pipeline.on_infra_excess = 'fail' to score them as failures and go on"
            )
        if not any(masked):
            return rollouts
        return [
            self._failed(r) if m and (by_prompt or ("version", str(rollout_version(r))) in self.flags) else r
            for r, m in zip(rollouts, masked)
        ]

    def _count(self, kind: Kind, key: str, rollouts: int, masked: int) -> None:
        cell = self.cells[kind].setdefault(key, Cell())
        cell.rollouts += rollouts
        cell.masked += masked

    def _check(self, kind: Kind, key: str) -> Flag | None:
        """The cell's new flag, if the rule flags it now (None if it was flagged before or is not)."""
        if (kind, key) in self.flags:
            return None
        cell = self.cells[kind][key]
        n, k = cell.rollouts, cell.masked
        if k < MIN_MASKED or k / n <= self.max_fraction or self.total.rollouts - n < n:
            return None
        base = (self.total.masked - k + 1) / (self.total.rollouts - n + 2)
        p_value = binomial_tail(n, k, base)
        if p_value >= ALPHA:
            return None
        flag = self.flags[(kind, key)] = Flag(kind, key, n, k, base, p_value)
        return flag

    def _failed(self, rollout: Rollout) -> Rollout:
        self.scored += 1
        self.scored_total += 1
        info = {**rollout.info, "masked_status": rollout.status}
        return Rollout(rollout.prompt_uid, rollout.completion, 0.0, EXCESS_STATUS, info)

    def step_metrics(self) -> dict[str, float]:
        """This step's masking metrics (see the module docstring); starts the next step's window."""
        prompts = [c.masked / c.rollouts for c in self.cells["prompt"].values() if c.rollouts >= MIN_MASKED]
        metrics = {
            "rollout/infra_frac": self.window.masked / max(self.window.rollouts, 1),
            "rollout/infra_frac_run": self.total.masked / max(self.total.rollouts, 1),
            "rollout/infra_prompt_frac_max": max(prompts, default=0.0),
            "rollout/infra_flagged_prompts": float(sum(kind == "prompt" for kind, _ in self.flags)),
            "rollout/infra_flagged_versions": float(sum(kind == "version" for kind, _ in self.flags)),
            "rollout/infra_scored": float(self.scored),
        }
        self.window, self.scored = Cell(), 0
        return metrics

    def summary(self) -> dict:
        """What `masking.json` holds: the rule's settings, the run's counts, every prompt with a
        masked rollout, every version, and the flags."""

        def table(kind: Kind, every: bool) -> dict:
            return {
                key: {**asdict(cell), "flagged": (kind, key) in self.flags}
                for key, cell in self.cells[kind].items()
                if every or cell.masked
            }

        return {
            "max_infra_fraction": self.max_fraction,
            "on_infra_excess": self.action,
            "min_masked": MIN_MASKED,
            "alpha": ALPHA,
            "rollouts": self.total.rollouts,
            "masked": self.total.masked,
            "scored_as_failures": self.scored_total,
            "prompts": table("prompt", every=False),
            "versions": table("version", every=True),
            "flags": [asdict(flag) for flag in self.flags.values()],
        }

    def write(self, path: Path) -> None:
        """`masking.json`, replaced atomically (a crash leaves the previous one)."""
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.summary(), indent=2))
        os.replace(tmp, path)
