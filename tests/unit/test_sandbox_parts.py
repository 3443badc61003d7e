"""The sandbox's parts on their own: slot allocator, cgroup files (against a fake tree, v1 and
v2), job packing as init unpacks it, the in-sandbox JSON encoder, limits."""

from __future__ import annotations

import io
import json
import marshal
import os

import pytest

from gapless.sandbox import SandboxLimits, boot
from gapless.sandbox.cgroups import CgroupRoot, SlotCgroup
from gapless.sandbox.job import Job
from gapless.sandbox.limits import MIB, SERVER_MEMORY_MB
from gapless.sandbox.slots import SlotAllocator


def test_slot_allocator_reuses_clean_slots_and_quarantines_dirty_ones():
    slots = SlotAllocator()
    first, second = slots.acquire(), slots.acquire()
    assert (first, second) == (0, 1)
    slots.release(first, is_clean=False)
    slots.release(second, is_clean=True)
    assert slots.acquire() == 1 and slots.acquire() == 2
    assert slots.quarantined == frozenset({0})


def test_a_retry_gets_another_slot():
    slots = SlotAllocator()
    slots.release(slots.acquire(), is_clean=True)
    assert slots.acquire(exclude=frozenset({0})) == 1  # slot 0 is free, but excluded
    assert slots.acquire() == 0


def test_slots_stay_owned_until_close(tmp_path):
    """Another process never gets a uid this one has used: its warm server may still run."""
    mine, theirs = SlotAllocator(500, tmp_path), SlotAllocator(500, tmp_path)  # flock is per fd
    assert mine.acquire() == 0
    assert theirs.acquire() == 1
    mine.release(0, is_clean=True)
    assert theirs.acquire() == 2  # 0 is idle but still mine
    assert mine.acquire() == 0
    mine.release(0, is_clean=True)
    mine.close()
    assert theirs.acquire() == 0


def test_sweep_cleans_only_slots_whose_owner_is_gone(tmp_path):
    live, sweeper = SlotAllocator(500, tmp_path), SlotAllocator(500, tmp_path)
    live.acquire()  # uid 500 is live elsewhere; uid 501 was left by a dead process
    cleaned: list[int] = []
    assert sweeper.sweep([0, 1], cleaned.append) == [1] and cleaned == [1]
    assert sweeper.acquire() == 1  # the sweep let go of it again


def fake_cgroup_tree(root, version: int):
    """A /proc/self and cgroup mounts in `root`, as on a v1 or v2 host."""
    proc = root / "proc"
    proc.mkdir()
    if version == 1:
        lines = [f"{30 + i} 1 0:{30 + i} / {root}/{name} rw - cgroup cgroup rw,{name}"
                 for i, name in enumerate(("pids", "memory", "cpuacct"))]  # fmt: skip
        (proc / "cgroup").write_text("3:pids:/\n2:memory:/job/a\n1:cpuacct:/\n")
        for name in ("pids", "memory/job/a", "cpuacct"):
            (root / name).mkdir(parents=True)
    else:
        lines = [f"30 1 0:30 / {root}/unified rw - cgroup2 cgroup2 rw"]
        (proc / "cgroup").write_text("0::/service\n")
        (root / "unified/service").mkdir(parents=True)
        (root / "unified/service/cgroup.controllers").write_text("cpu memory pids\n")
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return proc


def test_cgroup_v1_layout_and_counters(tmp_path):
    root, note = CgroupRoot.detect(fake_cgroup_tree(tmp_path, 1))
    if os.geteuid() != 0:
        assert root is None and "root" in note
        return
    assert root is not None and root.version == 1 and "v1" in note
    assert root.parents["memory"] == tmp_path / "memory/job/a/gapless-sandbox"  # under our own
    slot = SlotCgroup({n: p / "uid-7" for n, p in root.parents.items()}, 1)
    slot.ensure()
    slot.dirs["memory"].joinpath("memory.oom_control").write_text("oom_kill_disable 0\noom_kill 9\n")
    slot.job_memory.joinpath("memory.oom_control").write_text("oom_kill_disable 0\noom_kill 3\n")
    slot.dirs["pids"].joinpath("pids.events").write_text("max 2\n")
    slot.dirs["pids"].joinpath("cgroup.procs").write_text("11\n12\n")
    slot.dirs["cpuacct"].joinpath("cpuacct.usage").write_text("1500\n")
    counters = slot.counters()
    assert (counters.oom_kills, counters.pids_max_hits, counters.cpu_ns) == (3, 2, 1500)
    assert slot.pids() == {11, 12}
    slot.set_limits(70, 1 << 30)
    assert slot.dirs["pids"].joinpath("pids.max").read_text() == "70"
    # the jobs' child holds the run's limit; the slot's adds the server's own allowance
    assert slot.job_memory.joinpath("memory.limit_in_bytes").read_text() == str(1 << 30)
    slot_limit = int(slot.dirs["memory"].joinpath("memory.limit_in_bytes").read_text())
    assert slot_limit == (1 << 30) + SERVER_MEMORY_MB * MIB
    slot.attach_forker(42)  # the forker's memory cgroup is the jobs' child, its pids the slot's
    assert slot.job_memory.joinpath("cgroup.procs").read_text() == "42"
    assert slot.dirs["pids"].joinpath("cgroup.procs").read_text() == "42"
    assert root.stale_uids() == {7}


def test_cgroup_v2_needs_delegated_controllers(tmp_path):
    proc = fake_cgroup_tree(tmp_path, 2)
    root, note = CgroupRoot.detect(proc)
    if os.geteuid() != 0:
        return
    assert root is not None and root.version == 2, note
    assert (tmp_path / "unified/service/cgroup.subtree_control").read_text() == "+pids +memory"
    (tmp_path / "unified/service/cgroup.controllers").write_text("cpu\n")
    root, note = CgroupRoot.detect(proc)
    assert root is None and "lacks pids/memory" in note


def test_job_pack_is_what_init_unpacks(tmp_path):
    job = Job.of({"main.py": "print(1)\n", "pkg/data.bin": b"\x00\xff"}, "main.py", ["x"])
    fd = job.pack()
    try:
        boot._write_files(fd, str(tmp_path))
    finally:
        os.close(fd)
    assert (tmp_path / "main.py").read_text() == "print(1)\n"
    assert (tmp_path / "pkg/data.bin").read_bytes() == b"\x00\xff"
    assert oct((tmp_path / "main.py").stat().st_mode & 0o777) == "0o444"
    caps = job.tmpfs_caps()
    assert caps["inodes"] >= 4 and caps["bytes"] >= 3 * 4096


@pytest.mark.parametrize("name", ["/abs.py", "../up.py", "a/../b.py", "", "./x.py"])
def test_job_rejects_bad_names(name):
    with pytest.raises(ValueError):
        Job.of({name: "x"}, name)


def test_in_sandbox_json_lines_parse_as_json():
    fields = {"a": None, "b": True, "c": 3, "d": 1.5, "e": 'quote " back \\ nl \n tab \t é \ud800'}
    parsed = json.loads(boot._line(fields))
    assert parsed["a"] is None and parsed["b"] is True and parsed["c"] == 3 and parsed["d"] == 1.5
    assert parsed["e"].startswith('quote " back \\ nl \n tab \t é')


def test_requests_are_marshal_only():
    """The host sends plain data: marshal refuses code-carrying types at the host end."""
    with pytest.raises(ValueError):
        marshal.dumps({"x": io.BytesIO()})


def test_limits_derive_cgroup_and_rlimits():
    limits = SandboxLimits(memory_mb=256, tmp_size_mb=32, max_processes=10)
    assert limits.cgroup_memory_bytes == (256 + 32 + 64) << 20
    assert limits.cgroup_tasks(2) == 12
    rlimits = limits.rlimits(slot_tasks=3)
    assert rlimits["RLIMIT_NPROC"][0] > limits.cgroup_tasks(2)  # the cgroup, with its counter, first
    assert rlimits["RLIMIT_AS"] == (256 << 20, 256 << 20) and rlimits["RLIMIT_CORE"] == (0, 0)
    with pytest.raises(ValueError, match="max_files"):
        SandboxLimits(max_files=0)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_syscall_filter_is_well_formed_and_names_every_channel(machine):
    import struct

    from gapless.sandbox.seccomp import SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS, filter_program, syscall_numbers

    code = filter_program(machine)
    instructions = [struct.unpack("=HBBI", code[i : i + 8]) for i in range(0, len(code), 8)]
    assert 0 < len(instructions) <= 4096
    for index, (op, jt, jf, _) in enumerate(instructions):
        if op & 0x07 == 0x05:  # a jump: both targets inside the program
            assert index + 1 + max(jt, jf) < len(instructions)
    assert instructions[-1] == (0x06, 0, 0, SECCOMP_RET_ALLOW)
    assert (0x06, 0, 0, SECCOMP_RET_KILL_PROCESS) in instructions  # a foreign architecture
    compared = {k for op, _, _, k in instructions if op == 0x15}
    numbers = syscall_numbers(machine)
    for name in (
        "keyctl",
        "add_key",
        "request_key",
        "io_uring_setup",
        "inotify_init1",
        "fanotify_init",
        "ptrace",
        "bpf",
        "userfaultfd",
        "perf_event_open",
        "mount",
        "init_module",
        "kexec_load",
        "flock",
        "socket",
        "socketpair",
        "fcntl",
    ):
        assert numbers[name] in compared, name


def test_the_programs_clock_starts_at_its_start_line():
    """issue 21: start-up does not count against timeout_s. The anchor fd's first bytes move
    the deadline to then + the timeout, so a run whose start took longer than its initial
    deadline still completes (without the anchor it would be cut at that initial deadline)."""
    import threading
    import time

    from gapless.sandbox.streams import CappedSink, pump

    def run(with_anchor: bool) -> bool:
        status_read, status_write = os.pipe()
        out_read, out_write = os.pipe()
        os.write(status_write, b'{"started": true}\n')  # the start line, already there
        os.close(status_write)
        closer = threading.Timer(0.5, os.close, [out_write])  # the program ends after 0.5 s
        closer.start()
        sinks = {status_read: CappedSink(100), out_read: CappedSink(100)}
        try:
            return pump(sinks, time.monotonic() + 0.2, anchor=(status_read, 30.0) if with_anchor else None)
        finally:
            closer.join()
            for fd in sinks:
                os.close(fd)

    assert run(with_anchor=True) is True
    assert run(with_anchor=False) is False
