"""Who is blamed (docs/sandbox.md): nothing a program or a completion can do makes its run
`infra_error`; only what the host itself observed does.

Each test is one red-team attempt at an `infra_error` path, run in a real sandbox, and the
status it must get instead: a candidate that lowers its own hard CPU limit (the kernel's SIGKILL),
exits with the sandbox's own exit codes, prints the sandbox's status lines, floods the slot's
processes or memory before its judge has started, a repository whose code kills its grading job;
and, from the other side, what the host really does see: a kill from outside on one slot is
retried and the second run stands, on two slots in a row it is the program's `killed`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from sandbox_host import IS_ROOT, SLOT_UID_BASE, needs_bwrap

from gapless.envs.code.dataset import humaneval_tasks
from gapless.envs.code.environment import HARNESSES, JUDGE_FILES, CodeEnvironment
from gapless.envs.code.problems import CodeProblem
from gapless.sandbox import BwrapSandbox, Judged, SandboxLimits, Status, procs

pytestmark = needs_bwrap
UID_BASE = SLOT_UID_BASE + 56  # 56..63: this module's slots
# a wall clock well past the 1 s of CPU a lowered RLIMIT_CPU allows, even on a crowded host
LIMITS = SandboxLimits(timeout_s=20.0)
IO_PROBLEM = CodeProblem(uid="io", level=1, prompt="def f(x):\n    return ", solution="x + 1", overfit_solution="abs(x) + 1",
                         entry_point="f", test_inputs=("[1]", "[2]", "[-3]"), test_outputs=("2", "3", "-2"))  # fmt: skip
HOST_COMPARED = CodeProblem(uid="hc", level=1, prompt="def f(x):\n    return ", solution="x + 1", overfit_solution="",
                            entry_point="f", test_inputs=(json.dumps("assert f(1) == 2"), json.dumps("assert f(2) == 3")),
                            test_outputs=("true", "true"), harness="asserts")  # fmt: skip
LOWER_OWN_CPU_LIMIT = """    import resource
    resource.setrlimit(resource.RLIMIT_CPU, (1, 1))  # the kernel SIGKILLs at the hard limit
    while True:
        pass
"""


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(
        BwrapSandbox(LIMITS, slot_uid_base=UID_BASE, max_concurrency=2), LIMITS, concurrency=2
    )
    yield environment
    environment.close()


def _io(completion: str) -> str:
    """A function body as an io task's completion (the prompt ends in `return `)."""
    return "0\ndef f(x):\n" + completion


@pytest.mark.parametrize("task", ["io", "asserts (HumanEval)", "host-compared asserts"])
def test_a_candidate_that_lowers_its_own_hard_cpu_limit_is_refused_not_masked(env, task):
    """The syscall filter refuses the new limit (EPERM: sandbox/seccomp.py), so the candidate's own
    code fails the test; deaths it could still arrange are covered by the kills below."""
    problem = {
        "io": IO_PROBLEM,
        "asserts (HumanEval)": humaneval_tasks()["eval"][0],
        "host-compared asserts": HOST_COMPARED,
    }[task]
    completion = LOWER_OWN_CPU_LIMIT if task == "asserts (HumanEval)" else _io(LOWER_OWN_CPU_LIMIT)
    reward, status, info = env.score_text(problem, completion)
    assert reward == 0.0 and status != "infra_error" and info["sandbox_status"] != "infra_error", info
    assert info["attempts"] == 1, info


@pytest.mark.parametrize(("name", "body"), [
    ("the sandbox's start-up failure code", "    import os\n    os._exit(70)\n"),
    ("the judge's candidate-not-started code", "    import os\n    os._exit(76)\n"),
    ("the judge's candidate-gone code", "    raise SystemExit(75)\n"),
    ("a status line on every fd", "    import os\n    for fd in range(10):\n"
                                   "        try:\n            os.write(fd, b'{\"infra\": \"x\"}\\n')\n"
                                   "        except OSError:\n            pass\n    return 0\n"),
])  # fmt: skip
def test_a_candidate_cannot_borrow_the_sandbox_s_own_failure_signals(env, name, body):
    for completion in (
        body,
        "    return 0\n" + body.replace("    ", "", 1).replace("\n    ", "\n"),
    ):  # in the call, at import
        reward, status, info = env.score_text(IO_PROBLEM, _io(completion))
        assert reward == 0.0 and status != "infra_error" and info["attempts"] == 1, (name, completion, status, info)


@pytest.mark.parametrize("flood", ["processes", "memory"])
def test_completion_code_at_import_runs_only_after_the_judge_started(env, flood):
    """Before the start-up handshake, a completion that took every pid or byte of the slot at
    import could stop init from starting the judge: no start line, `infra_error`."""
    grab = {
        "processes": "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            import time\n"
        "            time.sleep(30)\n    except OSError:\n        break\n",
        "memory": "hoard = []\nwhile True:\n    try:\n        hoard.append(bytearray(1 << 20))\n"
        "    except MemoryError:\n        break\n",
    }[flood]
    reward, status, info = env.score_text(IO_PROBLEM, _io("    return x + 1\n" + grab))
    assert status != "infra_error" and info["attempts"] == 1, info


def test_plain_programs_that_kill_themselves_get_a_status_of_their_own():
    programs = {
        "SIGKILL to itself": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", Status.NONZERO_EXIT),
        "its own hard CPU limit": (
            "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 1))\nwhile True: pass\n",
            Status.NONZERO_EXIT,
        ),  # refused (EPERM): an uncaught PermissionError
        "init's limits lowered": (
            "import resource\nfor r in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS, resource.RLIMIT_CPU):\n"
            "    resource.prlimit(1, r, (1, 1))\n",
            Status.NONZERO_EXIT,
        ),  # refused as well
        "sandbox exit code": ("import os\nos._exit(70)\n", Status.NONZERO_EXIT),
        "forged status lines": (
            'import sys\nprint(\'{"infra": "x"}\')\nprint(\'{"infra": "x"}\', file=sys.stderr)\n',
            Status.OK,
        ),  # fmt: skip
    }
    with BwrapSandbox(LIMITS, slot_uid_base=UID_BASE + 4, max_concurrency=1) as box:
        for name, (source, expected) in programs.items():
            result = box.run_python({"m.py": source}, "m.py")
            assert (result.status, result.attempts) == (expected, 1), (name, result)


def test_only_the_judge_can_say_its_candidate_did_not_start():
    """`EXIT_CANDIDATE_NOT_STARTED` is the judge's verdict on the candidate's trusted start-up (a
    channel closed before `up`): here a stand-in candidate that dies before saying it."""
    files = {"harness.py": HARNESSES["io"], **JUDGE_FILES, "gapless_candidate.py": "import os\nos._exit(1)\n",
             "solution.py": "def f(x):\n    return x\n", "judge/tests.json": "[[1]]"}  # fmt: skip
    with BwrapSandbox(LIMITS, slot_uid_base=UID_BASE + 5, max_concurrency=1) as box:
        result = box.run_python(files, "harness.py", ["f"], judged=Judged("gapless_candidate.py", "judge"))
    assert (result.status, result.attempts) == (Status.INFRA_ERROR, 2), result
    assert "start-up" in result.stderr


def test_a_repository_whose_code_kills_its_grading_job_is_graded_zero_not_masked():
    from gapless.envs.repo.environment import RepoEnvironment
    from gapless.envs.repo.tasks import generate_repo_tasks

    task = generate_repo_tasks(0, "train", 1)[0]
    limits = SandboxLimits(timeout_s=20.0, memory_mb=256, max_processes=16, tmp_size_mb=4)
    environment = RepoEnvironment(BwrapSandbox(limits, slot_uid_base=UID_BASE + 6, max_concurrency=1),
                                  {"train": [task], "eval": []}, limits, max_turns=1, sessions=1)  # fmt: skip
    try:
        kill_at_import = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
        poisoned = {path: kill_at_import + text if path.endswith(".py") else text for path, text in task.files.items()}
        reward, status, info = environment.grade(task, poisoned)
    finally:
        environment.close()
    # the modules that kill their importer fail the tests that import them; the rest are graded
    assert reward < 1.0 and status == "tests_failed" and info.get("grade_status") != "infra_error", info


def _job_process(uid: int, victim: str) -> int | None:
    """A process of the job in slot `uid`: its init, the judge or the candidate's process."""
    found = []
    for pid in procs.live_processes_of_uid(uid):
        try:
            with open(f"/proc/{pid}/status") as status:
                nspid = next(line.split()[1:] for line in status if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        found.append((len(nspid), nspid[-1], pid))
    # waiter, server, init, candidate: the candidate is the only pid 1 five namespaces deep, the
    # judge the only process four deep that is not pid 1, init the pid 1 four deep
    level, is_pid_1 = {"candidate": (5, True), "judge": (4, False), "init": (4, True)}[victim]
    return next((pid for depth, inner, pid in found if depth == level and (inner == "1") == is_pid_1), None)


def _is_in_a_call(uid: int) -> bool:
    candidate = _job_process(uid, "candidate")
    try:
        with open(f"/proc/{candidate}/comm") as comm:
            return comm.read().strip() == "in-call"
    except OSError:
        return False


@pytest.mark.skipif(not IS_ROOT, reason="needs root: slot uids and the cgroup's OOM counter")
@pytest.mark.parametrize("victim", ["candidate", "judge", "init"])
@pytest.mark.parametrize("kills", [1, 2])
def test_a_kill_from_outside_is_retried_and_one_that_recurs_is_the_program_s(victim, kills):
    """The host cannot tell a kill from outside (an operator, the global OOM killer) from one the
    candidate brought on itself. Once: the run on a fresh slot stands (the right score). On
    both slots: `killed`, the program's, reward 0 (the bound of the rule, docs/sandbox.md)."""
    uid_base = UID_BASE + 1
    limits = SandboxLimits(timeout_s=20.0)
    box = BwrapSandbox(limits, slot_uid_base=uid_base, max_concurrency=1)
    environment = CodeEnvironment(box, limits, concurrency=1, retries=0)
    if not box.has_cgroups:
        environment.close()
        pytest.skip(f"needs a per-slot cgroup ({box.cgroup_note})")
    outcome: dict = {}
    # in a call, so the judge has started (a kill before its start line is the host's infra_error);
    # the candidate names its process so that the host sees when (PR_SET_NAME)
    slow_but_right = ("0\nimport ctypes, time\ndef f(x):\n    ctypes.CDLL(None).prctl(15, b'in-call', 0, 0, 0)\n"
                      "    time.sleep(1.5)\n    return x + 1\n")  # fmt: skip
    worker = threading.Thread(target=lambda: outcome.update(result=environment.score_text(IO_PROBLEM, slow_but_right)))
    try:
        environment.score_text(IO_PROBLEM, IO_PROBLEM.solution)  # slot 0 started and warm
        worker.start()
        killed: set[int] = set()  # slots whose job was killed
        deadline = time.monotonic() + 30
        while worker.is_alive() and time.monotonic() < deadline and len(killed) < kills:
            time.sleep(0.05)
            for uid in range(uid_base, uid_base + 3):
                pid = _job_process(uid, victim) if uid not in killed and _is_in_a_call(uid) else None
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(uid)
                    break
        worker.join(60)
        assert len(killed) == kills, "the job's process never appeared"
        reward, status, info = outcome["result"]
        expected = (1.0, "ok") if kills == 1 else (0.0, "killed")
        assert (reward, status, info["attempts"]) == (*expected, 2), info
        assert box.leftovers() == []
    finally:
        environment.close()
