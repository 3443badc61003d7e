"""Reward integrity: completions that try to forge their reward instead of solving the task.

Each forgery acts in the only process it has (the candidate's, envs/code/sandbox_scripts/candidate.py) against
a HumanEval task (asserts harness: `check(candidate)` in the judge) and a procedural io task (the
host compares outputs). Each must score 0 with the status listed; the correct solution still
scores 1. The attempts: patching builtins, comparison objects with a forged `__eq__`, writing
the report fd, the runner's frames and modules (`sys._getframe`, gc), exits and `SystemExit`,
signals to the parent and to every process, reading the tests from files and /proc, values the
host cannot parse (huge integers, deep nesting). The full HumanEval set is in test_humaneval.py.
"""

from __future__ import annotations

import pytest
from sandbox_host import SLOT_UID_BASE, needs_bwrap

from gapless.envs.code.dataset import humaneval_tasks
from gapless.envs.code.environment import CodeEnvironment
from gapless.envs.code.problems import CodeProblem
from gapless.sandbox import BwrapSandbox, SandboxLimits

pytestmark = needs_bwrap
LIMITS = SandboxLimits(timeout_s=5.0)
IO_PROBLEM = CodeProblem(uid="io", level=1, prompt="def f(x):\n    return ", solution="x + 1", overfit_solution="abs(x) + 1",
                         entry_point="f", test_inputs=("[1]", "[2]", "[-3]"), test_outputs=("2", "3", "-2"))  # fmt: skip
SECRET = "candidate([1.0, 2.0, 3.9"  # a line of HumanEval/0's hidden test

READ_THE_TESTS = f"""
    import glob
    found = []
    paths = glob.glob("/work/**", recursive=True) + glob.glob("/tmp/**", recursive=True)
    paths += glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ") + glob.glob("/proc/*/fd/*")
    paths += ["/proc/1/root/work/job/judge/tests.json", "/work/job/judge/tests.json", "/proc/self/mem"]
    for path in paths:
        try:
            with open(path, "rb") as handle:
                data = handle.read(1 << 20)
        except (OSError, ValueError):
            continue
        if bytes.fromhex({SECRET.encode().hex()!r}) in data or bytes.fromhex("5b2d335d") in data:
            found.append(path)
    print("REACHED" if found else "nothing found", found)
    return True
"""
FRAMES_AND_GC = f"""
    import gc, sys
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            if hasattr(value, "write") and value not in (sys.stdout, sys.stderr):
                try:
                    value.write('{{"i": 0, "out": true}}\\n')
                except Exception:
                    pass
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, str) and bytes.fromhex({SECRET.encode().hex()!r}).decode() in obj:
            print("REACHED the tests in memory")
    return True
"""
FORGERIES = {  # name -> (completion continuing the prompt, status it must get)
    "patch builtins": (
        """    return None
import builtins
builtins.AssertionError = type("Quiet", (Exception,), {})
builtins.__import__ = None
""",
        "wrong_answer",
    ),
    "patch isinstance (breaks its own encoder)": (
        """    return True
import builtins
builtins.isinstance = lambda *args: True
""",
        "harness_incomplete",
    ),
    "object with a forged __eq__": (
        """    class Anything:
        def __eq__(self, other):
            return True
        __ne__ = lambda self, other: False
    return Anything()
""",
        "wrong_answer",
    ),
    "int subclass with a forged __eq__": (
        """    class Yes(int):
        def __eq__(self, other):
            return True
    return Yes(0)
""",
        "wrong_answer",
    ),
    "results written to the report fd": (
        """    return None
import os
for i in range(8):
    os.write(3, b'{"i": %d, "out": true}\\n' % i)
""",
        "harness_incomplete",
    ),
    "frames and gc": (FRAMES_AND_GC, "wrong_answer"),
    "os._exit(0) during the call": ("    import os\n    os._exit(0)\n", "harness_incomplete"),
    "os._exit(0) at import": ("    return True\nimport os\nos._exit(0)\n", "harness_incomplete"),
    "SystemExit during the call": ("    raise SystemExit(0)\n", "wrong_answer"),  # that call's failure
    "AssertionError raised on purpose": ("    raise AssertionError\n", "wrong_answer"),
    "signals to the parent and to every process": (
        """    import os, signal
    for pid in (0, -1, 1, os.getppid()):
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    return True
""",
        "wrong_answer",
    ),
    "read the tests from files and /proc": (READ_THE_TESTS, "wrong_answer"),
    "an integer past the int-str limit": ("    return 10 ** 5000\n", "wrong_answer"),
    "nesting past the depth bound": (
        """    value = []
    for _ in range(100000):
        value = [value]
    return value
""",
        "wrong_answer",
    ),
}


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(BwrapSandbox(LIMITS, slot_uid_base=SLOT_UID_BASE, max_concurrency=4), LIMITS,
                                  concurrency=4)  # fmt: skip
    yield environment
    environment.close()


@pytest.fixture(scope="module")
def humaneval_0():
    return humaneval_tasks()["eval"][0]


@pytest.mark.parametrize("name", FORGERIES)
def test_forgery_scores_zero_on_humaneval(env, humaneval_0, name):
    completion, status = FORGERIES[name]
    reward, got_status, info = env.score_text(humaneval_0, completion)
    assert (reward, got_status) == (0.0, status), info
    assert "REACHED" not in info["stdout_tail"], info["stdout_tail"]


@pytest.mark.parametrize("name", ["read the tests from files and /proc", "frames and gc", "results written to the report fd",
                                  "signals to the parent and to every process"])  # fmt: skip
def test_forgery_scores_zero_on_an_io_task(env, name):
    completion, status = FORGERIES[name]
    completion = "0\ndef f(x):\n" + completion if completion.startswith("    ") else "0\n" + completion
    reward, got_status, info = env.score_text(IO_PROBLEM, completion)
    assert reward == 0.0 and got_status in (status, "wrong_answer"), info
    assert "REACHED" not in info["stdout_tail"], info["stdout_tail"]


def test_the_real_solutions_still_pass(env, humaneval_0):
    assert env.score_text(humaneval_0, humaneval_0.solution)[:2] == (1.0, "ok")
    assert env.score_text(IO_PROBLEM, IO_PROBLEM.solution)[:2] == (1.0, "ok")


WATCHER = """
import ctypes, fcntl, os, time
libc = ctypes.CDLL(None, use_errno=True)
watch = libc.inotify_init1(os.O_NONBLOCK)
print("inotify", "REACHED" if watch >= 0 else ctypes.get_errno())
null = os.open("/dev/null", os.O_WRONLY)
try:
    fcntl.lockf(null, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a flag the other job could test
    print("lock REACHED")
except OSError as error:
    print("lock", error.errno)
time.sleep(1.0)
"""
PROBER = """
import fcntl, os, struct, time
time.sleep(0.3)
for name in sorted(os.listdir("/usr/lib/python3.11"))[:50]:
    try:
        os.close(os.open(os.path.join("/usr/lib/python3.11", name), os.O_RDONLY))
    except OSError:
        pass
null = os.open("/dev/null", os.O_WRONLY)
try:
    query = fcntl.fcntl(null, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
    print("held by the other job" if struct.unpack("hhqqi", query)[0] != fcntl.F_UNLCK else "free", "REACHED")
except OSError as error:
    print("getlk", error.errno)
"""


def test_two_concurrent_jobs_cannot_signal_through_locks_or_watch_file_opens():
    from concurrent.futures import ThreadPoolExecutor

    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE + 40, max_concurrency=2) as box:
        with ThreadPoolExecutor(2) as pool:
            watcher = pool.submit(box.run_python, {"m.py": WATCHER}, "m.py")
            prober = pool.submit(box.run_python, {"m.py": PROBER}, "m.py")
            results = [watcher.result(), prober.result()]
    assert {r.slot for r in results} == {0, 1}  # really two jobs at once, in two slots
    for result in results:
        assert result.status.value == "ok" and "REACHED" not in result.stdout, (result.stdout, result.stderr)


@pytest.mark.slow
def test_forgeries_score_zero_on_all_of_humaneval():
    """Every forgery on all 164 (those that return `True`, a plausible answer to some task,
    return None instead: a forgery must not pass whatever it returns)."""
    from gapless.types import Completion

    tasks = humaneval_tasks()["eval"]
    names = list(FORGERIES)
    limits = SandboxLimits(timeout_s=10.0)
    environment = CodeEnvironment(BwrapSandbox(limits, slot_uid_base=SLOT_UID_BASE + 48, max_concurrency=8), limits,
                                  concurrency=8)  # fmt: skip
    try:
        texts = [FORGERIES[name][0].replace("return True", "return None") for name in names]
        groups = environment.score_groups(tasks, [[Completion([], [], [], [], "stop", text) for text in texts]
                                                  for _ in tasks])  # fmt: skip
    finally:
        environment.close()
    leaks = [(r.prompt_uid, name, r.status) for group in groups for name, r in zip(names, group) if r.reward != 0.0]
    assert leaks == []
    assert all(r.status != "infra_error" for group in groups for r in group)
