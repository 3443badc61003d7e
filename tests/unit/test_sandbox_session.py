"""Stateful sandbox sessions: files and a live process across calls, snapshot/restore, idle
timeout; the host is clean after each test."""

from __future__ import annotations

import os
import signal
import time

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SnapshotFailed, Status, procs

pytestmark = needs_bwrap
LIMITS = SandboxLimits(timeout_s=2.0)


@pytest.fixture
def box(clean_host):
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=2) as sandbox:
        yield sandbox
        assert sandbox.leftovers() == []


def test_state_and_files_persist_across_calls(box):
    with box.open_session(LIMITS) as session:
        first = session.run("x = 41\nopen('notes.txt', 'w').write('hello')\nprint('set')")
        second = session.run("x += 1\nimport os\nprint(x, open('notes.txt').read(), os.getcwd())")
        assert first.status is Status.OK and first.stdout == "set\n" and not first.restarted
        assert second.status is Status.OK and second.stdout == "42 hello /work/session\n"
        failed = session.run("raise ValueError('nope')")
        assert failed.status is Status.NONZERO_EXIT and "ValueError: nope" in failed.error
        assert "ValueError" in failed.stderr
        assert session.run("print(x)").stdout == "42\n"  # an exception does not end the process


def test_a_timeout_ends_the_live_process_but_keeps_the_files(box):
    with box.open_session(LIMITS) as session:
        session.run("x = 1\nopen('kept.txt', 'w').write('kept')")
        started = time.monotonic()
        stuck = session.run("while True:\n    pass", timeout_s=1.0)
        assert stuck.status is Status.TIMEOUT and stuck.restarted
        assert time.monotonic() - started < 1.0 + 20  # a hang guard: the status above is the check
        after = session.run("print('x' in globals(), open('kept.txt').read())")
        assert after.status is Status.OK and after.stdout == "False kept\n" and after.restarted


def test_exit_and_os_exit_inside_a_session(box):
    with box.open_session(LIMITS) as session:
        assert session.run("import sys\nsys.exit(3)").error == "SystemExit: 3"
        gone = session.run("import os\nos._exit(0)")
        assert gone.status is Status.NONZERO_EXIT and gone.restarted
        assert session.run("print('back')").stdout == "back\n"


def test_snapshot_restores_files_and_values_in_another_session(box):
    with box.open_session(LIMITS) as session:
        session.run("data = {'a': [1, 2]}\nopen('f.txt', 'w').write('v1')")
        snapshot = session.snapshot()
        session.run("data['a'].append(3)\nopen('f.txt', 'w').write('v2')")
        assert session.restore(snapshot).status is Status.OK
        assert session.run("print(data, open('f.txt').read())").stdout == "{'a': [1, 2]} v1\n"
    with box.open_session(LIMITS) as other:
        other.restore(snapshot)
        assert other.run("print(data['a'], open('f.txt').read())").stdout == "[1, 2] v1\n"


def test_sessions_keep_the_sandbox(box):
    with box.open_session(LIMITS) as session:
        result = session.run(
            "import os\nfor p in ('/etc/shadow', '/work/job/repl.py'):\n"
            "    try:\n        open(p, 'a')\n        print('REACHED')\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "print(sorted({l.split()[1] for l in open('/proc/self/status')\n"
            "              if l.startswith(('CapInh', 'CapPrm', 'CapEff', 'CapAmb'))}))"
        )
        assert result.stdout == "FileNotFoundError\nPermissionError\n['0000000000000000']\n"


def test_idle_timeout_closes_the_session_and_frees_its_slot(box):
    session = box.open_session(LIMITS, idle_timeout_s=0.5)
    assert session.run("print(1)").stdout == "1\n"
    time.sleep(1.2)
    assert session.is_closed
    with pytest.raises(SandboxError, match="closed"):
        session.run("print(2)")


def test_a_long_call_is_not_idle_time(box):
    with box.open_session(SandboxLimits(timeout_s=3.0), idle_timeout_s=0.5) as session:
        assert session.run("import time\ntime.sleep(1.0)\nprint('slept')").stdout == "slept\n"
        assert not session.is_closed and session.run("print('still here')").stdout == "still here\n"


def test_the_namespace_state_is_never_in_the_session_files(box):
    with box.open_session(LIMITS) as session:
        session.run("secret = 7\nopen('f.txt', 'w').write('v1')")
        snapshot = session.snapshot()
        assert session.run("import os\nprint(sorted(os.listdir('.')))").stdout == "['f.txt']\n"
        session.run("open('.gapless-session-state.pickle', 'wb').write(b'forged')")  # the old state file's name
        crashed = session.run("import os\nos._exit(1)")
        assert crashed.restarted
        # a new live process starts empty: no state file to reload, forged or not
        assert session.run("print('secret' in globals())").stdout == "False\n"
        assert session.restore(snapshot).status is Status.OK
        listing = session.run("import os\nprint(sorted(os.listdir('.')), secret)")
        assert listing.stdout == "['f.txt'] 7\n"


def test_a_snapshot_that_does_not_unpickle_fails_the_restore_not_the_session(box):
    with box.open_session(LIMITS) as session:
        session.run(
            "class Trap:\n    def __reduce__(self):\n        return (int, ('not a number',))\n"
            "trap = Trap()\nkept = 1\nopen('f.txt', 'w').write('v1')"
        )
        snapshot = session.snapshot()  # it pickles: int('not a number') runs only on load
    with box.open_session(LIMITS) as other:
        restored = other.restore(snapshot)
        assert restored.status is Status.NONZERO_EXIT and "ValueError" in restored.error
        assert "files were restored" in restored.error
        after = other.run("print(open('f.txt').read(), 'kept' in globals())")
        assert after.status is Status.OK and after.stdout == "v1 False\n"


# -- replies the model's code forges on the reply channel (fd 3), and who a slot failure blames --


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(8, "little") + body


FORGED = [
    _frame(b'{"ok": true, "snapshot": "!!! not base64 !!!"}'),  # the old reply shape, bad base64
    _frame(b'{"ok": "yes"}'),  # wrong types
    _frame(b'{"ok": true, "snapshot_bytes": 5}') + _frame(b"abc"),  # a size that does not match
    _frame(b"[" * 100_000),  # nesting, over the header cap
    (2**63).to_bytes(8, "little"),  # a length no host could hold
    _frame(b'{"ok": true}') * 3,  # several replies
    b"\xff" * 20,  # garbage
]


@pytest.mark.parametrize("forged", FORGED, ids=[str(i) for i in range(len(FORGED))])
def test_forged_frames_during_a_snapshot_and_a_restore_are_statuses(box, forged):
    plant = (
        "import os\nclass Forger:\n    def __reduce__(self):\n"
        f"        os.write(3, {forged!r})\n        return (int, ('1',))\nforger = Forger()"
    )
    with box.open_session(LIMITS) as session:
        assert session.run(plant).status is Status.OK
        try:  # pickling the namespace runs the forger: its frames come before the real reply
            session.snapshot()
        except SnapshotFailed as failed:
            assert failed.result.status is not Status.INFRA_ERROR and not failed.result.is_lost
        after = session.run("print('still serving')")
        assert after.status is Status.OK and after.stdout == "still serving\n"
    # a snapshot whose loading writes the forged frames first: early frames during a restore
    with box.open_session(LIMITS) as session:
        session.run(
            f"import os\nclass Early:\n    def __reduce__(self):\n        return (os.write, (3, {forged!r}))\n"
            "early = Early()\nopen('f.txt', 'w').write('v1')"
        )
        snapshot = session.snapshot()
    with box.open_session(LIMITS) as other:
        restored = other.restore(snapshot)
        assert restored.status is not Status.INFRA_ERROR and not restored.is_lost
        after = other.run("print(open('f.txt').read())")
        assert after.status is Status.OK and after.stdout == "v1\n"


def _peak_growth_mb(call) -> float:
    """How far the host's resident memory peaks above where it was, in MiB, while `call` runs."""

    def status_kb(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak (VmHWM) to the current resident size
    before_kb = status_kb("VmRSS:")
    call()
    return (status_kb("VmHWM:") - before_kb) / 1024


def test_a_16_mib_reply_frame_costs_the_host_its_cap_not_its_size(box):
    flood = "import os\nos.write(3, (16 << 20).to_bytes(8, 'little') + b'[' * (16 << 20))"
    with box.open_session(LIMITS) as session:
        results = []
        growth_mb = _peak_growth_mb(lambda: results.append(session.run(flood)))
        assert results[0].status is Status.OUTPUT_LIMIT and results[0].violation and results[0].restarted
        assert growth_mb < 8  # refused from its length: not one byte of its body is kept
        assert session.run("print('back')").stdout == "back\n"
        # a forged snapshot reply of 16 MiB is within a snapshot's cap: held once, never decoded
        session.run(
            "import os\nclass Big:\n    def __reduce__(self):\n"
            '        head = b\'{"ok": true, "snapshot_bytes": %d}\' % (16 << 20)\n'
            "        os.write(3, len(head).to_bytes(8, 'little') + head)\n"
            "        os.write(3, (16 << 20).to_bytes(8, 'little') + b'\\0' * (16 << 20))\n"
            "        os._exit(0)  # before the real reply: the forged one is all there is\n"
            "big = Big()"
        )
        blobs = []
        growth_mb = _peak_growth_mb(lambda: blobs.append(session.snapshot()))
        assert len(blobs[0]) == 16 << 20 and growth_mb < 3 * 16 + 8


def _kill_server(session) -> None:
    """SIGKILL the session's slot server (as the OOM killer would), and wait until bwrap is gone."""
    worker = session._slot.worker
    waiters = procs.child_pids(worker._process.pid)  # bwrap's pid 1, whose child is the server
    for server in [pid for waiter in waiters for pid in procs.child_pids(waiter)]:
        os.kill(server, signal.SIGKILL)
    worker._process.wait()


def test_a_slot_that_fails_after_the_models_code_ran_is_the_models_not_infra(box):
    with box.open_session(LIMITS) as session:
        assert session.run("x = 1").status is Status.OK
        session.run("import os\nos._exit(1)")  # the next call must start a new live process
        _kill_server(session)  # a death the model's code could have caused: the host cannot tell
        lost = session.run("print(x)")
        assert lost.is_lost and lost.status is Status.NONZERO_EXIT and session.is_closed
        assert session.run("print(1)").is_lost  # and it stays the model's outcome
        with pytest.raises(SnapshotFailed):
            session.snapshot()


def test_a_slot_that_fails_before_any_model_code_is_infra(box):
    with box.open_session(LIMITS) as session:
        _kill_server(session)
        failed = session.run("print(1)")
        assert failed.status is Status.INFRA_ERROR and not failed.is_lost
