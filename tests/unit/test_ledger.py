"""The ledger across crashes: segments, run_lost and rolled_back at a resume, a torn last line,
and the rules `check_ledger` enforces (each broken on purpose)."""

from __future__ import annotations

import json

import pytest

from gapless.orchestrate.ledger import GroupEvent, GroupLedger, check_ledger, read_events


def _write_segment(ledger: GroupLedger, trained: dict[int, int], open_groups: list[int]) -> None:
    """trained: group -> step; open_groups: admitted, never ended (the crash)."""
    for group, step in trained.items():
        ledger.write(GroupEvent(group, "admitted", uid=f"u{group}", born=step))
        ledger.write(
            GroupEvent(group, "trained", uid=f"u{group}", born=step, step=step, oldest_version=step, staleness=0)
        )
    for group in open_groups:
        ledger.write(GroupEvent(group, "admitted", uid=f"u{group}", born=3))


def test_resume_closes_the_crashed_segment(tmp_path):
    path = tmp_path / "groups.jsonl"
    # segment 0: 2 groups per step, steps 0-3 trained, groups 8 and 9 in flight; checkpoint at step 2
    ledger = GroupLedger(path)
    _write_segment(ledger, {g: g // 2 for g in range(8)}, [8, 9])
    ledger._fh.write('{"group": 10, "event": "adm')  # torn by the kill
    ledger.close()
    ledger = GroupLedger(path, resume_step=2)
    assert ledger.segment == 1
    _write_segment(ledger, {4: 2, 5: 2, 6: 3, 7: 3}, [])  # the new segment trains steps 2 and 3 again
    ledger.close()
    events = read_events(path)
    assert all(line.startswith("{") and line.endswith("}") for line in path.read_text().splitlines())
    lost = sorted(e["group"] for e in events if e.get("reason") == "run_lost")
    rolled = sorted((e["group"], e["step"]) for e in events if e["event"] == "rolled_back")
    assert lost == [8, 9] and all(e["segment"] == 0 for e in events if e.get("reason") == "run_lost")
    assert rolled == [(4, 2), (5, 2), (6, 3), (7, 3)]
    check_ledger(events, steps=4, groups_per_step=2)
    # a second resume from the same checkpoint rolls back the new segment's steps, never twice the old one's
    ledger = GroupLedger(path, resume_step=2)
    ledger.close()
    events = read_events(path)
    assert ledger.segment == 2
    rolled = [(e["segment"], e["group"]) for e in events if e["event"] == "rolled_back"]
    assert len(rolled) == len(set(rolled)) == 8


def test_check_ledger_names_each_broken_rule(tmp_path):
    path = tmp_path / "groups.jsonl"
    ledger = GroupLedger(path)
    _write_segment(ledger, {0: 0, 1: 0, 2: 1, 3: 1}, [])
    ledger.close()
    good = read_events(path)
    check_ledger(good, steps=2, groups_per_step=2)
    with pytest.raises(AssertionError, match="not ended exactly once"):
        check_ledger(good + [{"group": 9, "event": "admitted", "segment": 0}], 2, 2)
    with pytest.raises(AssertionError, match="not ended exactly once"):
        check_ledger(good + [dict(good[1])], 2, 2)  # group 0 trained twice
    with pytest.raises(AssertionError, match="step 1"):
        check_ledger([e for e in good if e["group"] != 3], 2, 2)
    with pytest.raises(AssertionError, match="admitted twice"):
        check_ledger(good + [dict(good[0])], 2, 2)


def test_event_lines_are_plain_json():
    line = GroupEvent(3, "dropped", 1, "u3", born=2, reason="straggler", step=4).to_json()
    assert json.loads(line) == {
        "group": 3,
        "event": "dropped",
        "segment": 1,
        "uid": "u3",
        "born": 2,
        "step": 4,
        "reason": "straggler",
    }
