"""`gapless sandbox run` and `gapless sandbox check` (on two probes; the full table runs in
test_sandbox_hostile.py)."""

from __future__ import annotations

import json

from sandbox_host import SLOT_UID_BASE, needs_bwrap

import gapless.sandbox
from gapless.cli import main
from gapless.envs.code import probes as code_probes
from gapless.sandbox import probes

pytestmark = needs_bwrap


def test_sandbox_check_prints_probe_status_and_host_clean(monkeypatch, capsys, clean_host):
    real_open = gapless.sandbox.open_sandbox
    monkeypatch.setattr(gapless.sandbox, "open_sandbox",
                        lambda **kw: real_open(slot_uid_base=SLOT_UID_BASE, **kw))  # fmt: skip
    chosen = [p for p in probes.PROBES if p.name in ("fork bomb", "TCP to the host")]
    monkeypatch.setattr(probes, "PROBES", tuple(chosen))
    monkeypatch.setattr(code_probes, "HARNESS_PROBES", ())
    assert main(["sandbox", "check", "--path", "warm"]) == 0
    out = capsys.readouterr().out
    assert "probe" in out and "host clean" in out
    assert "fork bomb" in out and "process_limit" in out
    assert "2/2 probes ended as expected with a clean host" in out


def test_sandbox_run_json(tmp_path, capsys):
    program = tmp_path / "p.py"
    program.write_text("print('hi')\n")
    assert main(["sandbox", "run", str(program), "--json", "--timeout-s", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "ok" and record["stdout"] == "hi\n" and record["cpu_s"] is not None
