"""Reduced mode (no bwrap): rlimits and process groups only, loud at start, and honest about it."""

from __future__ import annotations

import logging

from sandbox_host import SLOT_UID_BASE

from gapless.sandbox import ReducedSandbox, SandboxError, SandboxLimits, Status, open_sandbox
from gapless.sandbox.seccomp import syscall_numbers


def test_reduced_mode_warns_loudly_and_still_limits(clean_host, caplog, capsys):
    with caplog.at_level(logging.WARNING):
        box = open_sandbox(mode="reduced", slot_uid_base=SLOT_UID_BASE, max_concurrency=2)
    try:
        assert isinstance(box, ReducedSandbox) and box.path == "reduced"
        assert "REDUCED MODE" in caplog.text and "REDUCED MODE" in capsys.readouterr().err
        fast = SandboxLimits(timeout_s=1.0)
        assert box.run_python({"m.py": "while True: pass"}, "m.py", limits=fast).status is Status.TIMEOUT
        bomb = box.run_python({"m.py": "x = bytearray(8 << 30)"}, "m.py")
        assert bomb.status is Status.MEMORY_LIMIT
        daemon = box.run_python(
            {
                "m.py": (
                    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                    "        time.sleep(60)\n    os._exit(0)\nprint('done')"
                )
            },
            "m.py",
        )
        assert daemon.status is Status.OK and daemon.stdout == "done\n"
        assert box.leftovers() == []  # the subreaper took the daemon down with the run
    finally:
        box.close()


def test_auto_mode_without_bwrap_falls_back_loudly(clean_host, monkeypatch, capsys):
    monkeypatch.setattr("shutil.which", lambda name: None)
    box = open_sandbox(mode="auto", slot_uid_base=SLOT_UID_BASE, max_concurrency=1)
    try:
        assert box.mode == "reduced" and "bwrap not found" in capsys.readouterr().err
    finally:
        box.close()
    try:
        open_sandbox(mode="bwrap", slot_uid_base=SLOT_UID_BASE)
        raise AssertionError("mode=bwrap must not fall back")
    except SandboxError as error:
        assert "bwrap not found" in str(error)


def test_code_tasks_refuse_to_start_in_reduced_mode(clean_host):
    """issue 21: in reduced mode the candidate could read its tests, so a code task never
    starts there (it would train on zeros or on forgeable rewards): one line, naming the fix."""
    from gapless.config import ConfigError
    from gapless.envs.code.environment import CodeEnvironment

    box = open_sandbox(mode="reduced", slot_uid_base=SLOT_UID_BASE, max_concurrency=1)
    try:
        CodeEnvironment(box, SandboxLimits(), concurrency=1)
        raise AssertionError("a code environment started in reduced mode")
    except ConfigError as error:
        message = str(error)
        assert "\n" not in message and "bubblewrap" in message and "sandbox.mode" in message
    finally:
        box.close()


def test_reduced_mode_keeps_the_syscall_filter(clean_host):
    code = (
        "import ctypes, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.syscall({syscall_numbers()['keyctl']}, 0, -3, 0), ctypes.get_errno())\n"
        "try:\n    socket.socket(40, socket.SOCK_STREAM)\nexcept OSError as error:\n    print(error.errno)\n"
    )
    box = open_sandbox(mode="reduced", slot_uid_base=SLOT_UID_BASE, max_concurrency=1)
    try:
        result = box.run_python({"m.py": code}, "m.py")
        assert result.status is Status.OK and result.stdout.split() == ["-1", "1", "97"], result
    finally:
        box.close()
