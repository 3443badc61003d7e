"""The group ledger: `groups.jsonl`, one line per event in a group's life, kept across crashes.

Every line is a `GroupEvent`. A run is a sequence of *segments*: segment 0 is the first start,
each `--resume` opens the next one. Group indices restart at a resume (admission numbers groups
from the checkpoint's step), so a group is named by (segment, group).

    admitted      the generator started the group (uid of its prompt, born = policy version)
    trained       the trainer consumed it at `step` (staleness from its oldest token's version)
    dropped       it ended without training, with a `reason`: straggler, surplus, zero_variance,
                  infra_error, over_budget, run_ended, run_stopped (SIGTERM/SIGINT), run_failed
                  (an actor failed or stalled), run_lost (written at the next start: the segment
                  crashed while the group was in flight)
    rolled_back   written at a resume: the group was trained at a step after the checkpoint the
                  run resumed from, so that step is trained again by the new segment

Rules (tests/integration/test_faults.py checks them after crashes): in each segment every
admitted group ends (trained or dropped) exactly once; the trained groups that are not rolled
back cover every step once, each step from a single segment. Scored groups carry their rewards
and statuses, dropped ones too, so a run can be audited from this file alone.
Not guaranteed: a line torn by a crash mid-write is discarded at the next start (its group is
then `run_lost`, or its training step rolled back, like any other unrecorded event).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gapless.types import DropReason

END_EVENTS = ("trained", "dropped")


@dataclass
class GroupEvent:
    group: int
    event: str  # admitted | trained | dropped | rolled_back
    segment: int = 0
    uid: str | None = None  # the prompt's task uid
    born: int | None = None  # policy version at admission
    step: int | None = None  # trainer step that trained, dropped or rolled back the group
    oldest_version: int | None = None  # oldest policy version among its tokens
    staleness: int | None = None  # step - oldest_version, for trained groups
    reason: DropReason | None = None  # why it was dropped
    rewards: list[float] | None = None  # scored groups: one per rollout (None for infra errors)
    statuses: list[str] | None = None
    resumed_at: int | None = None  # rolled_back / run_lost: the step the next segment starts from
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        record = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        return json.dumps({**record, **self.extra})


def read_events(path: Path) -> list[dict]:
    """Every complete line of a ledger; a torn last line (a crash mid-write) is left out."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            record.setdefault("segment", 0)
            events.append(record)
    return events


class GroupLedger:
    """Append-only writer of `groups.jsonl` for one segment. `resume_step` (a resumed run: the
    step of the checkpoint it continues from) closes what the crashed segments left open."""

    def __init__(self, path: Path, resume_step: int | None = None):
        previous = read_events(path) if resume_step is not None else []
        self.segment = 1 + max((e["segment"] for e in previous), default=-1) if previous else 0
        if previous:  # rewrite without a torn tail, so new lines never glue onto half a line
            path.write_text("".join(json.dumps(e) + "\n" for e in previous))
        self._fh = open(path, "a" if previous else "w")
        if previous:
            self._reconcile(previous, resume_step)

    def write(self, event: GroupEvent) -> None:
        if event.event != "rolled_back" and event.reason != DropReason.RUN_LOST:
            event.segment = self.segment
        self._fh.write(event.to_json() + "\n")
        self._fh.flush()

    def _reconcile(self, previous: list[dict], resume_step: int) -> None:
        ended = {(e["segment"], e["group"]) for e in previous if e["event"] in END_EVENTS}
        rolled = {(e["segment"], e["group"]) for e in previous if e["event"] == "rolled_back"}
        for e in previous:
            key = (e["segment"], e["group"])
            if e["event"] == "admitted" and key not in ended:
                ended.add(key)
                self.write(
                    GroupEvent(
                        e["group"],
                        "dropped",
                        e["segment"],
                        e.get("uid"),
                        e.get("born"),
                        reason=DropReason.RUN_LOST,
                        resumed_at=resume_step,
                    )
                )
            elif e["event"] == "trained" and e["step"] >= resume_step and key not in rolled:
                self.write(
                    GroupEvent(
                        e["group"],
                        "rolled_back",
                        e["segment"],
                        e.get("uid"),
                        e.get("born"),
                        step=e["step"],
                        resumed_at=resume_step,
                    )
                )

    def close(self) -> None:
        self._fh.close()


def check_ledger(events: list[dict], steps: int, groups_per_step: int) -> None:
    """Raise AssertionError naming the first broken rule (used by the tests and the fault sweep)."""
    by_segment: dict[int, list[dict]] = {}
    for e in events:
        by_segment.setdefault(e["segment"], []).append(e)
    for segment, seg_events in by_segment.items():
        admitted = [e["group"] for e in seg_events if e["event"] == "admitted"]
        ended = [e["group"] for e in seg_events if e["event"] in END_EVENTS]
        if len(admitted) != len(set(admitted)):
            raise AssertionError(f"segment {segment}: a group was admitted twice")
        if sorted(ended) != sorted(admitted):
            missing = sorted(set(admitted) - set(ended))[:5]
            twice = sorted({g for g in ended if ended.count(g) > 1})[:5]
            raise AssertionError(f"segment {segment}: groups not ended exactly once (open {missing}, twice {twice})")
    rolled = {(e["segment"], e["group"]) for e in events if e["event"] == "rolled_back"}
    kept = [e for e in events if e["event"] == "trained" and (e["segment"], e["group"]) not in rolled]
    for step in range(steps):
        at_step = [e for e in kept if e["step"] == step]
        segments = {e["segment"] for e in at_step}
        if len(at_step) != groups_per_step or len(segments) != 1:
            raise AssertionError(
                f"step {step}: {len(at_step)} kept trained groups from segments {sorted(segments)}, "
                f"want {groups_per_step} from one"
            )
    if any(e["step"] >= steps for e in kept):
        raise AssertionError("a kept trained group is past the last step")
