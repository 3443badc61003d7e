"""Stateful sandbox sessions: files and a live process across calls, snapshot/restore, idle
timeout; the host is clean after each test."""

from __future__ import annotations

import time

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.sandbox import BwrapSandbox, SandboxError, SandboxLimits, Status

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
        session.run("class Trap:\n    def __reduce__(self):\n        return (int, ('not a number',))\n"
                    "trap = Trap()\nkept = 1\nopen('f.txt', 'w').write('v1')")
        snapshot = session.snapshot()  # it pickles: int('not a number') runs only on load
    with box.open_session(LIMITS) as other:
        restored = other.restore(snapshot)
        assert restored.status is Status.NONZERO_EXIT and "ValueError" in restored.error
        assert "files were restored" in restored.error
        after = other.run("print(open('f.txt').read(), 'kept' in globals())")
        assert after.status is Status.OK and after.stdout == "v1 False\n"
