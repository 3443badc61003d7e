"""Behaviour of the bubblewrap sandbox on both paths (warm: forked from a slot's server; cold: a
fresh bwrap and interpreter per job): results, limits, retries, slots. The hostile behaviours
are in test_sandbox_hostile.py. Every test here ends with the host checked clean (conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.sandbox import BwrapSandbox, SandboxError, SandboxLimits, SandboxResult, Status, procs

pytestmark = needs_bwrap
FAST = SandboxLimits(timeout_s=1.5)


def run(box: BwrapSandbox, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    return box.run_python({"main.py": textwrap.dedent(code)}, "main.py", limits=limits)


def test_check_passes(sandbox):
    sandbox.check()


def test_trivial_program(sandbox):
    files = {
        "main.py": "import os, sys\nfrom pkg import helper\nprint(helper.X, sys.argv[1:], os.getcwd(), os.getpid())\n",
        "pkg/__init__.py": "",
        "pkg/helper.py": "X = 42\n",
    }
    result = sandbox.run_python(files, "main.py", args=["a", "b"])
    assert result.status is Status.OK, result.stderr
    assert result.stdout == "42 ['a', 'b'] /tmp 2\n"  # pid 2: init of its own namespace is 1
    assert result.exit_code == 0 and result.signal is None and result.limit is None
    assert result.wall_s > 0 and result.cpu_s is not None and not result.truncated
    assert result.path == sandbox.path and result.slot is not None and result.attempts == 1
    assert json.loads(json.dumps(result.to_json()))["status"] == "ok"


def test_report_channel_and_stdin(sandbox):
    result = run(sandbox, "import os, sys\nos.write(3, b'hello')\nprint(repr(sys.stdin.read()))\n")
    assert result.status is Status.OK, result.stderr
    assert result.report == b"hello" and result.stdout == "''\n"


def test_exit_codes(sandbox):
    assert run(sandbox, "raise SystemExit(3)\n").exit_code == 3
    assert run(sandbox, "raise SystemExit(3)\n").status is Status.NONZERO_EXIT
    said = run(sandbox, "import sys\nsys.exit('bye')\n")
    assert said.exit_code == 1 and said.stderr == "bye\n"
    killed = run(sandbox, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert killed.status is Status.NONZERO_EXIT and killed.signal == 11


def test_traceback_is_the_programs_own(sandbox):
    result = run(sandbox, "def f():\n    raise ValueError('boom')\nf()\n")
    assert result.status is Status.NONZERO_EXIT and result.exit_code == 1
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "/work/job/main.py"')
    assert result.stderr.endswith("ValueError: boom\n") and "<string>" not in result.stderr


def test_compile_error(sandbox):
    result = run(sandbox, "def broken(:\n")
    assert result.status is Status.COMPILE_ERROR and "SyntaxError" in result.stderr


def test_faked_sandbox_error_is_the_programs_failure(sandbox):
    result = run(sandbox, "import sys\nsys.stderr.write('bwrap: oops\\n')\nsys.exit(1)\n")
    assert result.status is Status.NONZERO_EXIT


def test_threads_are_joined_and_atexit_runs(sandbox):
    result = run(
        sandbox,
        """
        import atexit, threading, time
        atexit.register(lambda: print("atexit"))
        def late():
            time.sleep(0.2)
            print("thread")
        threading.Thread(target=late).start()
        print("main")
    """,
    )
    assert result.status is Status.OK and result.stdout == "main\nthread\natexit\n"


def test_jobs_do_not_share_state(sandbox):
    """Fresh random seed, fresh /tmp, no module state from an earlier job of the slot."""
    code = """
        import os, random, sys
        print(random.random(), os.listdir("/tmp"), hasattr(sys, "marked"))
        sys.marked = True
        open("/tmp/left-behind", "w").write("x")
    """
    first, second = run(sandbox, code), run(sandbox, code)
    assert first.status is Status.OK and second.status is Status.OK
    assert first.stdout.split()[0] != second.stdout.split()[0]
    assert second.stdout.split(maxsplit=1)[1] == "[] False\n"


def test_cpu_limit_stops_spinning(sandbox):
    result = run(sandbox, "while True:\n    pass\n", SandboxLimits(timeout_s=5, cpu_s=1))
    assert result.status is Status.TIMEOUT and result.limit == "cpu"


def test_infinite_loop_reports_cpu_time(sandbox):
    result = run(sandbox, "while True:\n    pass\n", FAST)
    assert result.status is Status.TIMEOUT and result.limit == "wall"
    assert FAST.timeout_s <= result.wall_s < FAST.timeout_s + 1.0
    assert result.cpu_s is not None and result.cpu_s > 0.1


def test_file_size_limit(sandbox):
    result = run(sandbox, "open('/tmp/big', 'wb').write(b'x' * (20 << 20))\n")
    assert result.status is Status.DISK_LIMIT and result.limit == "disk", result.stderr


def test_small_tmpfs(sandbox):
    code = "for i in range(4):\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * (4 << 20))\n"
    result = run(sandbox, code, SandboxLimits(tmp_size_mb=8))
    assert result.status is Status.DISK_LIMIT and "No space left" in result.stderr


def test_inode_cap_counts_files_and_directories(sandbox):
    code = "import os\nfor i in range(200):\n    os.mkdir(f'/tmp/d{i}')\n"
    result = run(sandbox, code, SandboxLimits(max_files=100))
    assert result.status is Status.INODE_LIMIT and result.limit == "inodes"


def test_fork_bombs_do_not_starve_other_runs(sandbox):
    bomb = """
        import os, time
        count = 0
        try:
            for _ in range(5000):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                count += 1
        except OSError:
            pass
        print(count, flush=True)
        time.sleep(1.0)
    """
    limits = SandboxLimits(timeout_s=5)
    with ThreadPoolExecutor(max_workers=2) as pool:
        bombs = [pool.submit(run, sandbox, bomb, limits) for _ in range(2)]
        time.sleep(0.7)  # both bombs now hold their whole process budget
        trivial = run(sandbox, "print('alive')\n")
        bomb_results = [bomb.result() for bomb in bombs]
    assert trivial.status is Status.OK and trivial.stdout == "alive\n", trivial.stderr
    for result in bomb_results:
        assert result.status is Status.OK, result.stderr
        assert int(result.stdout) >= limits.max_processes - 4  # each had its own budget
        if sandbox.has_cgroups:  # exactly: the program itself and its children, no more
            assert int(result.stdout) == limits.max_processes - 1


def test_output_flood_is_truncated(sandbox):
    result = run(sandbox, "import sys\nsys.stdout.write('x' * (1 << 20))\n")
    assert result.status is Status.OUTPUT_LIMIT and result.limit == "output"
    assert result.truncated and len(result.stdout) == FAST.max_output_bytes


def test_run_file(tmp_path, sandbox):
    program = tmp_path / "prog.py"
    program.write_text("print('from file')\n")
    result = sandbox.run_file(program)
    assert result.status is Status.OK and result.stdout == "from file\n"


def test_bad_job_is_rejected(sandbox):
    with pytest.raises(ValueError):
        sandbox.run_python({"../x.py": "print(1)"}, "../x.py")
    with pytest.raises(ValueError):
        sandbox.run_python({"a.py": "print(1)"}, "b.py")
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)


def test_concurrent_runs_and_metrics(sandbox):
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda i: run(sandbox, f"print({i})\n"), range(32)))
    assert [result.stdout for result in results] == [f"{i}\n" for i in range(32)]
    assert {result.slot for result in results} <= set(range(sandbox.max_concurrency))
    metrics = sandbox.metrics()
    assert metrics["sandbox/runs_total"] == 32 and metrics["sandbox/infra_errors_total"] == 0
    assert metrics["sandbox/run_s_p99"] >= metrics["sandbox/run_s_p50"] > 0


def test_arun_keeps_the_event_loop_free(sandbox):
    async def main() -> tuple[list[SandboxResult], float]:
        loop = asyncio.get_running_loop()
        worst_lag = 0.0

        async def ticker() -> None:
            nonlocal worst_lag
            while True:
                start = loop.time()
                await asyncio.sleep(0.005)
                worst_lag = max(worst_lag, loop.time() - start - 0.005)

        tick = asyncio.create_task(ticker())
        jobs = [sandbox.arun_python({"m.py": f"print({i})"}, "m.py") for i in range(24)]
        results = await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)
        tick.cancel()
        return results, worst_lag

    results, worst_lag = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(24)]
    assert worst_lag < 0.5  # no spawn ran on the loop (a blocked loop stalls for the whole burst)


def test_missing_interpreter_is_an_infra_error_retried_on_another_slot(clean_host):
    with BwrapSandbox(python="/nonexistent/python", slot_uid_base=SLOT_UID_BASE) as box:
        result = box.run_python({"m.py": "print(1)"}, "m.py")
        assert result.status is Status.INFRA_ERROR and result.attempts == 2
        assert "bwrap" in result.stderr or "python" in result.stderr
        assert box.metrics()["sandbox/infra_retries_total"] == 1
        assert box.metrics()["sandbox/infra_errors_total"] == 1
        with pytest.raises(SandboxError, match="python3"):
            box.check()


def test_a_broken_server_is_restarted(clean_host):
    """A warm server that dies between jobs is noticed before the next job uses its slot."""
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=1) as box:
        first = box.run_python({"m.py": "print(1)"}, "m.py")
        worker = box._pool._slots[first.slot].worker
        waiter = procs.child_pids(worker._process.pid)[0]  # bwrap monitor -> its pid 1 -> server
        server = procs.child_pids(waiter)[0]
        os.kill(server, signal.SIGKILL)  # its waiter and bwrap follow it out
        worker._process.wait(timeout=5)
        second = box.run_python({"m.py": "print(2)"}, "m.py")
        assert second.status is Status.OK and second.stdout == "2\n" and second.attempts == 1
        assert box.metrics()["sandbox/slot_restarts_total"] == 1


def test_a_warm_server_is_replaced_after_its_job_quota(clean_host, monkeypatch):
    monkeypatch.setattr("gapless.sandbox.worker.MAX_JOBS_PER_SERVER", 3)
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=1) as box:
        results = [box.run_python({"m.py": f"print({i})"}, "m.py") for i in range(7)]
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(7)]
        assert box.metrics()["sandbox/slot_restarts_total"] == 2


def test_without_bwrap_runs_fail_instead_of_running_bare(clean_host, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=1) as box:
        result = box.run_python({"m.py": "print(1)"}, "m.py")
        assert result.status is Status.INFRA_ERROR and "bwrap not found" in result.stderr
        with pytest.raises(SandboxError, match="bwrap not found"):
            box.check()
