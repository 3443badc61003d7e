"""Hostile-input tests of the bubblewrap sandbox: one hostile behaviour per test.

Every test that runs a program also checks, through the `sandbox` fixture, that the host is
clean afterwards: no process of any slot uid left (when running as root), no job directory
left in the temp dir, no slot quarantined.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gapless.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxResult, Status
from gapless.sandbox import procs
from gapless.sandbox.slots import SlotAllocator

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bwrap not installed: apt-get install bubblewrap to run the sandbox tests",
)

SLOT_UID_BASE = 210000  # away from the default so a test run never touches a live service
SLOT_UID_SPAN = 64
IS_ROOT = os.geteuid() == 0
FAST = SandboxLimits(timeout_s=1.5)


def _slot_processes() -> list[tuple[int, int, str]]:
    slot_uids = range(SLOT_UID_BASE, SLOT_UID_BASE + SLOT_UID_SPAN)
    return [process for process in procs.scan_processes() if process[1] in slot_uids]


@pytest.fixture
def sandbox(monkeypatch):
    """A sandbox whose job dirs go to a private parent (other processes may use /tmp too)."""
    job_parent = Path(tempfile.mkdtemp(prefix="gapless-test-jobs-", dir="/tmp"))
    job_parent.chmod(0o711)  # slot uids must traverse it to reach their own job dir
    monkeypatch.setattr(tempfile, "tempdir", str(job_parent))
    box = BwrapSandbox(slot_uid_base=SLOT_UID_BASE)
    yield box
    try:
        assert list(job_parent.iterdir()) == [], "a job directory was left on the host"
        assert box.quarantined_uids == frozenset()
        if IS_ROOT:
            assert _slot_processes() == [], "processes of a slot uid outlived their run"
    finally:
        shutil.rmtree(job_parent)


def run(box: BwrapSandbox, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    return box.run_python({"main.py": textwrap.dedent(code)}, "main.py", limits=limits)


def test_check_passes(sandbox):
    sandbox.check()


def test_trivial_program(sandbox):
    files = {
        "main.py": "import os, sys\nfrom pkg import helper\n"
        "print(helper.X, sys.argv[1:], os.getcwd())\n",
        "pkg/__init__.py": "",
        "pkg/helper.py": "X = 42\n",
    }
    result = sandbox.run_python(files, "main.py", args=["a", "b"])
    assert result.status is Status.OK, result.stderr
    assert result.stdout == "42 ['a', 'b'] /tmp\n"
    assert result.exit_code == 0 and result.signal is None and result.limit is None
    assert result.wall_s > 0 and not result.truncated
    assert json.loads(json.dumps(result.to_json()))["status"] == "ok"


def test_infinite_loop_hits_the_deadline(sandbox):
    result = run(sandbox, "while True:\n    pass\n", FAST)
    assert result.status is Status.TIMEOUT and result.limit == "wall"
    assert result.exit_code is None
    assert FAST.timeout_s <= result.wall_s < FAST.timeout_s + 1.0


def test_sleep_past_the_deadline(sandbox):
    result = run(sandbox, "import time\ntime.sleep(60)\n", FAST)
    assert result.status is Status.TIMEOUT and result.limit == "wall"
    assert result.wall_s < FAST.timeout_s + 1.0


def test_cpu_limit_stops_spinning(sandbox):
    result = run(sandbox, "while True:\n    pass\n", SandboxLimits(timeout_s=5, cpu_s=1))
    assert result.status is Status.TIMEOUT and result.limit == "cpu"


def test_memory_bomb(sandbox):
    result = run(sandbox, "block = bytearray(4 << 30)\n")
    assert result.status is Status.MEMORY_LIMIT and result.limit == "memory"
    assert "MemoryError" in result.stderr


FORK_BOMB = """
    import os, time
    count = 0
    try:
        for _ in range(5000):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            count += 1
    finally:
        print(count, flush=True)
"""


def test_fork_bomb_is_capped(sandbox):
    result = run(sandbox, FORK_BOMB, SandboxLimits(timeout_s=5))
    assert result.status is Status.PROCESS_LIMIT, result.stderr
    assert 0 < int(result.stdout) < SandboxLimits().max_processes
    assert result.wall_s < 3.0  # the children die with the run, not after their sleep


def test_fork_bombs_do_not_starve_other_runs(sandbox):
    holding_bomb = FORK_BOMB.replace("finally:", "except OSError:") + "    time.sleep(1.5)\n"
    limits = SandboxLimits(timeout_s=5)
    with ThreadPoolExecutor(max_workers=2) as pool:
        bombs = [pool.submit(run, sandbox, holding_bomb, limits) for _ in range(2)]
        time.sleep(0.7)  # both bombs now hold their whole process budget
        trivial = run(sandbox, "print('alive')\n")
        bomb_results = [bomb.result() for bomb in bombs]
    assert trivial.status is Status.OK and trivial.stdout == "alive\n", trivial.stderr
    for bomb in bomb_results:
        assert bomb.status is Status.OK, bomb.stderr
        assert int(bomb.stdout) >= limits.max_processes - 8  # each had its own budget


def test_host_loopback_is_unreachable(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run(sandbox, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
                print("connected")
            except OSError as error:
                print(type(error).__name__)
        """)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.status is Status.OK, result.stderr
    assert result.stdout == "ConnectionRefusedError\n"


def test_external_network_fails_fast(sandbox):
    result = run(sandbox, """
        import socket, time
        start = time.monotonic()
        for host in ("192.0.2.1", "example.com"):
            try:
                socket.create_connection((host, 80), timeout=3)
                print("connected")
            except OSError as error:
                print(type(error).__name__)
        print(time.monotonic() - start < 1.0)
    """)
    assert result.status is Status.OK, result.stderr
    assert "connected" not in result.stdout and result.stdout.endswith("True\n")


def test_writes_outside_tmp_fail(sandbox):
    targets = ["/usr/x", "/work/job/x", "/work/job/main.py", "/x", "/dev/x", "/etc/x"]
    result = run(sandbox, f"""
        import json
        outcome = {{}}
        for path in {targets!r} + ["/tmp/x", "/dev/shm/x"]:
            try:
                with open(path, "w") as handle:
                    handle.write("x")
                outcome[path] = "written"
            except OSError as error:
                outcome[path] = error.strerror
        print(json.dumps(outcome))
    """)
    assert result.status is Status.OK, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome.pop("/tmp/x") == "written" and outcome.pop("/dev/shm/x") == "written"
    assert "written" not in outcome.values(), outcome
    assert not Path("/usr/x").exists()


def test_host_files_are_invisible(sandbox):
    secret = Path.home() / f"gapless-sandbox-secret-{os.getpid()}"
    secret.write_text("secret")
    try:
        paths = ["/etc/shadow", str(secret), str(Path(__file__).resolve()), "/root", "/home"]
        result = run(sandbox, f"""
            import json, os
            print(json.dumps({{"visible": [p for p in {paths!r} if os.path.exists(p)],
                              "root": sorted(os.listdir("/")), "work": os.listdir("/work")}}))
        """)
    finally:
        secret.unlink()
    assert result.status is Status.OK, result.stderr
    seen = json.loads(result.stdout)
    assert seen["visible"] == []
    host_links = {name for name in ("bin", "lib", "lib64", "sbin") if os.path.lexists(f"/{name}")}
    assert seen["root"] == sorted({"dev", "proc", "tmp", "usr", "work"} | host_links)
    assert seen["work"] == ["job"]


def test_cannot_remount_read_only_binds(sandbox):
    result = run(sandbox, """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        print(libc.mount(b"none", b"/work/job", None, MS_REMOUNT | MS_BIND, None),
              os.strerror(ctypes.get_errno()))
    """)
    assert result.status is Status.OK, result.stderr
    assert result.stdout.startswith("-1 ")


def test_cannot_nest_user_namespaces(sandbox):
    result = run(sandbox, """
        import ctypes
        CLONE_NEWUSER = 0x10000000
        print(ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER))
    """)
    assert result.status is Status.OK, result.stderr
    assert result.stdout == "-1\n"


def test_output_flood_is_truncated(sandbox):
    result = run(sandbox, "import sys\nsys.stdout.write('x' * (1 << 20))\n")
    assert result.status is Status.OUTPUT_LIMIT and result.limit == "output"
    assert result.truncated and len(result.stdout) == FAST.max_output_bytes


def test_report_channel(sandbox):
    result = run(sandbox, "import os\nos.write(3, b'hello')\n")
    assert result.status is Status.OK, result.stderr
    assert result.report == b"hello"


def test_nonzero_exit(sandbox):
    result = run(sandbox, "raise SystemExit(3)\n")
    assert result.status is Status.NONZERO_EXIT and result.exit_code == 3


def test_syntax_error(sandbox):
    result = run(sandbox, "def broken(:\n")
    assert result.status is Status.NONZERO_EXIT and result.exit_code == 1
    assert "SyntaxError" in result.stderr


def test_faked_sandbox_error_is_the_programs_failure(sandbox):
    result = run(sandbox, "import sys\nsys.stderr.write('bwrap: oops\\n')\nsys.exit(1)\n")
    assert result.status is Status.NONZERO_EXIT


def test_daemon_does_not_outlive_the_run(sandbox):
    result = run(sandbox, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.close(1)
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert result.status is Status.OK and result.wall_s < 1.0  # no wait for the daemon
    # the fixture checks that no process of the slot uid is left


def test_file_size_limit(sandbox):
    result = run(sandbox, "open('/tmp/big', 'wb').write(b'x' * (20 << 20))\n")
    assert result.status is Status.DISK_LIMIT and result.limit == "disk", result.stderr


def test_tmpfs_size_limit(sandbox):
    code = "for i in range(4):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (4 << 20))\n"
    result = run(sandbox, code, SandboxLimits(tmp_size_mb=8))
    assert result.status is Status.DISK_LIMIT and "No space left" in result.stderr


def test_missing_interpreter_is_an_infra_error():
    box = BwrapSandbox(python="/nonexistent/python", slot_uid_base=SLOT_UID_BASE)
    result = box.run_python({"m.py": "print(1)"}, "m.py")
    assert result.status is Status.INFRA_ERROR
    assert "bwrap:" in result.stderr
    with pytest.raises(SandboxError, match="python3"):
        box.check()


def test_concurrent_runs(sandbox):
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda i: run(sandbox, f"print({i})\n"), range(32)))
    assert [result.status for result in results] == [Status.OK] * 32
    assert [result.stdout for result in results] == [f"{i}\n" for i in range(32)]


def test_bad_job_is_rejected(sandbox):
    with pytest.raises(ValueError):
        sandbox.run_python({"../x.py": "print(1)"}, "../x.py")
    with pytest.raises(ValueError):
        sandbox.run_python({"a.py": "print(1)"}, "b.py")
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)


def test_run_file(tmp_path, sandbox):  # tmp_path first: made before tempdir is patched
    program = tmp_path / "prog.py"
    program.write_text("print('from file')\n")
    result = sandbox.run_file(program)
    assert result.status is Status.OK and result.stdout == "from file\n"


def test_slot_allocator_reuses_clean_slots_and_quarantines_dirty_ones():
    slots = SlotAllocator()
    first, second = slots.acquire(), slots.acquire()
    assert (first, second) == (0, 1)
    slots.release(first, is_clean=False)
    slots.release(second, is_clean=True)
    assert slots.acquire() == 1 and slots.acquire() == 2
    assert slots.quarantined == frozenset({0})


def test_slot_allocators_of_two_processes_never_share_a_uid(tmp_path):
    mine, theirs = SlotAllocator(500, tmp_path), SlotAllocator(500, tmp_path)  # flock is per fd
    assert mine.acquire() == 0
    assert theirs.acquire() == 1  # slot 0 is locked by the other allocator
    mine.release(0, is_clean=True)
    assert theirs.acquire() == 0
    assert mine.acquire() == 2
