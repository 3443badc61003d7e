"""Hostile programs, one behaviour per test, on both paths: each must end within its deadline
with the expected status, and leave the host clean.

The probes are the table that `gapless sandbox check` runs (gapless.sandbox.probes), so this is
exactly what the command reports. Per probe, "clean" is checked by `run_probe`: no trap on the
host reached (TCP, UDP, unix and abstract sockets, a secret in the host home, a directory outside
the sandbox), no process of a finished run left in any slot, the host's mounts unchanged, no job
directory left; after each path's sandbox closes, no process, cgroup or flock of a slot uid.
"""

from __future__ import annotations

import pytest
from sandbox_host import SLOT_UID_BASE, assert_host_clean, host_state, needs_bwrap

from gapless.envs.code.probes import HARNESS_PROBES
from gapless.sandbox import BwrapSandbox
from gapless.sandbox.probes import PROBES, run_probe

pytestmark = needs_bwrap
KILL_GRACE_S = 2.5  # the deadline's kill, the reap and, on the cold path, bwrap's own exit


@pytest.fixture(scope="module", params=["warm", "cold"])
def sandbox(request):
    before = host_state()
    box = BwrapSandbox(slot_uid_base=SLOT_UID_BASE, warm=request.param == "warm", max_concurrency=2)
    yield box
    box.close()
    assert_host_clean(before)


@pytest.mark.parametrize("probe", PROBES + HARNESS_PROBES, ids=[probe.name for probe in PROBES + HARNESS_PROBES])
def test_probe(sandbox, probe):
    if probe.needs_cgroup and not sandbox.has_cgroups:
        pytest.skip(f"needs a per-slot cgroup ({sandbox.cgroup_note})")
    outcome = run_probe(sandbox, probe)
    assert outcome.is_expected, outcome.detail
    assert outcome.is_host_clean, outcome.detail
    assert outcome.wall_s < probe.limits.timeout_s + KILL_GRACE_S


def test_signal_to_init_at_first_instruction_is_ignored(sandbox):
    """Regression: the job's init once reset its SIGINT handler only after forking the
    program, so a program signalling pid 1 at once could win the race and turn the run into
    infra_error. Repeat it so the race window is hit if it still exists."""
    code = "import os, signal\nos.kill(1, signal.SIGINT)\nos.kill(1, signal.SIGTERM)\nprint('alive')\n"
    statuses = [sandbox.run_python({"main.py": code}, "main.py").status.value for _ in range(20)]
    assert statuses == ["ok"] * 20
    code = "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"  # as in a plain `python`
    result = sandbox.run_python({"main.py": code}, "main.py")
    assert result.status.value == "nonzero_exit" and "KeyboardInterrupt" in result.stderr


def test_memory_pressure_kills_the_job_not_the_slot_server():
    """A job that lowers its processes' oom_score_adj and fills its memory cgroup with small
    processes and tmpfs pages ends as memory_limit; the slot's server (not in the jobs' memory
    cgroup) serves the next job itself, with no restart."""
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, warm=True, max_concurrency=1) as box:
        if not box.has_cgroups:
            pytest.skip(f"needs a per-slot cgroup ({box.cgroup_note})")
        assert box.run_python({"main.py": "print(1)\n"}, "main.py").stdout == "1\n"
        worker = next(iter(box._pool._slots.values())).worker
        server_pids = set(worker._infra)
        probe = next(p for p in PROBES if p.keeps_server)
        result = box.run_python({"main.py": probe.code}, "main.py", limits=probe.limits)
        assert result.status.value == "memory_limit"
        after = box.run_python({"main.py": "print(2)\n"}, "main.py")
        assert after.status.value == "ok" and after.stdout == "2\n"
        assert set(worker._infra) == server_pids  # the very same server, forker and waiter
        assert box.metrics()["sandbox/slot_restarts_total"] == 0
