"""Code that runs inside the sandbox: the slot's server, each job's init and the program's start.

The host starts `python -I -B -c <this source> <spec: marshal, hex>` (in bubblewrap, or bare in
reduced mode) and talks to it over a unix socket. Process tree of one slot, all under its uid:

    waiter   bwrap's pid 1; unshares a pid namespace, forks the server into it, waits for it
     `- server   pid 1 of that namespace; keeps CAP_SYS_ADMIN of the slot's innermost user
         |       namespace (nothing of the host's); never runs job code; mounts the slot's
         |       devpts (capped), forks the forker, says ready, waits for the forker
         `- forker   serves jobs one at a time: unshares a pid namespace, forks init into it,
             |       `setns` back to its own; oom_score_adj 1000, a floor the host sets
             `- init  pid 1 of the job's pid namespace; unshares mount and IPC namespaces, mounts
                 |    /proc, a tmpfs with size AND inode caps
                 |    at /tmp (also seen at /dev/shm), a read-only tmpfs at /work/job holding the
                 |    job's files; reaps; when the program exits, reports its status and exits, and
                 |    the kernel kills whatever is left of the job's namespace
                 |- program  closes every other fd, sets rlimits, drops every capability, checks
                 |           that none is left, installs the syscall filter, compiles main, writes
                 |           its start marker, runs main (a judged job: the judge, not dumpable)
                 `- candidate   judged jobs only (envs/code/environment.py): forked before init writes the job's
                                files, so its memory never held the tests; pid 1 of its own pid
                                namespace, its own session, its own mount namespace with a fresh
                                /proc and an empty mount over the private directory; then a program
                                like the judge, whose fd 3 is the channel to it (fd 5 of the judge)

Channels, per job (the host makes them; the server only passes them on):
- a memfd with the job's files, read by init after the fork, so the long-lived server never
  holds one job's data when the next job is forked from it;
- stdout, stderr, the report pipe (the program's fd 3) and, for sessions, stdin;
- the status pipe: the program writes one line (`started` or `compile_error`) and closes it
  before main's first line runs; init writes the final line (exit status, which filesystem was
  full, CPU time). The program cannot forge either: it never holds the pipe again, and init
  keeps its capabilities, so the program may not open init's fds through /proc nor trace it.
Each job also gets a fresh, empty session keyring (init joins one before forking anything).
Requests come as marshal data from the host (trusted); everything sent back is JSON, which the
host parses as untrusted. The server answers each job with init's wait status.

Reduced mode (`isolate` false: no bwrap): no namespaces, no mounts, no capabilities; init is a
child subreaper that kills the program's leftover descendants, files go to host directories.

Importing this module does nothing. It uses only the standard library of the sandbox's python,
and imports as little as it can: a cold start pays for every module here.
"""

import _signal
import _socket
import ctypes
import gc
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x08000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
PR_SET_CHILD_SUBREAPER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 47, 4
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
CLONE_NEWCGROUP = 0x02000000
KEYCTL_JOIN_SESSION_KEYRING = 1
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
CAPABILITY_VERSION_3 = 0x20080522
FD_STDIN, FD_STDOUT, FD_STDERR, FD_REPORT, FD_STATUS = 0, 1, 2, 3, 4
FD_CANDIDATE = 5  # a judged job's judge: its channel to the candidate's process
EXIT_INFRA = 70  # init or the program's start-up failed before main ran: the sandbox's fault
CANDIDATE_GRACE_S = 1.0  # for a judged job's candidate to end after its judge (then it is killed)
MAX_PTYS = 8  # pseudo terminals of a slot at once (its jobs run one at a time)
EXIT_CANDIDATE_GONE = 75  # the judge's exit when its candidate's channel closed (envs/code/sandbox_scripts/judge.py)
_libc = ctypes.CDLL(None, use_errno=True)
_FILTER = None  # the program's syscall filter (bytes), from the server's spec


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, options=None):
    def enc(s):
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(options)), f"mount {target}")


def _line(fields):
    """One JSON line for the host, without the json module (its import costs a cold start
    milliseconds): values are None, bools, numbers and strings only."""

    def encode(value):
        if value is None or isinstance(value, bool):
            return {None: "null", True: "true", False: "false"}[value]
        if isinstance(value, (int, float)):
            return repr(value)
        escaped = (c if c >= " " and c not in '"\\' else "\\u%04x" % ord(c) for c in str(value))
        return '"' + "".join(escaped) + '"'

    body = ", ".join(f'"{key}": {encode(value)}' for key, value in fields.items())
    return ("{" + body + "}\n").encode("utf-8", "replace")


def _receive(control):
    """One request (marshal, from the trusted host) and the fds that came with it."""
    message, ancillary, _, _ = control.recvmsg(1 << 16, _socket.CMSG_LEN(8 * 4))
    fds = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += [int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, usable, 4)]
    return (marshal.loads(message) if message else None), fds


def serve(spec):
    """The slot's server: answer job requests on the control socket until EOF or max_jobs."""
    global _FILTER
    _FILTER = spec["filter"]
    control = _socket.socket(fileno=spec["control_fd"])
    own_pid_namespace = None
    if spec["isolate"]:
        _check(_libc.unshare(CLONE_NEWNS), "unshare mount namespace")  # one that we own
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        # The slot's own devpts instance (bwrap's /dev/ptmx links into it), capped: the kernel
        # counts every pty of the host against one kernel.pty.max.
        _mount(
            "devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, f"newinstance,ptmxmode=0666,mode=0620,max={MAX_PTYS}"
        )
        if spec.get("session") and not spec["session"].get("cow"):  # a cow session's is mounted (cow.py)
            _mount_tmpfs("/work/session", spec["session"], mode="0700")
        for name in spec.get("preimport", ()):
            __import__(name)
        _become_pid_namespace_owner(control)
        own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    else:  # orphans of a job killed at its deadline come to us, not to the host's pid 1
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    gc.freeze()  # jobs forked from here never scan (so never copy) the server's objects
    note = _JobNote()
    forker = os.fork()
    if forker == 0:
        try:
            _serve_jobs(spec, control, own_pid_namespace, note)
        finally:
            os._exit(0)
    control.send(_line({"ready": os.getpid()}))
    _, wait_status = os.waitpid(forker, 0)
    if os.WIFSIGNALED(wait_status):  # the OOM killer chose it (the job's own memory pressure)
        _finish_for_dead_forker(control, note)


class _JobNote:
    """What the forker is doing, in memory it shares with the server: the sequence number of
    the job in flight (0: none) and its init's pid (0: not forked yet)."""

    def __init__(self):
        import mmap

        self._memory = mmap.mmap(-1, 16)  # anonymous and shared: the fork keeps one copy

    def write(self, seq, pid):
        self._memory[:16] = seq.to_bytes(8, "little") + pid.to_bytes(8, "little")

    def read(self):
        raw = self._memory[:16]
        return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def _serve_jobs(spec, control, own_pid_namespace, note):
    """The forker: answer job requests on the control socket until EOF or max_jobs. It is the
    parent of every job's init; the host sets its oom_score_adj to 1000, which also becomes
    the floor of every process it forks (an unprivileged process may lower its own only down
    to that floor), so inside the slot's memory cgroup a job's process is always the OOM
    killer's choice before the server. The forker itself may be chosen: the server then
    finishes the job in flight and exits (`_finish_for_dead_forker`)."""
    if not spec["isolate"]:
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    for job_index in range(spec["max_jobs"]):
        request, fds = _receive(control)
        if request is None:
            break
        note.write(request["seq"], 0)
        if job_index == 0 and spec["isolate"]:  # the host has moved us into the slot's cgroup by
            _check(_libc.unshare(CLONE_NEWCGROUP), "unshare the cgroup namespace")  # now: its root
        try:
            pid = _fork_job(request, fds, spec, control, own_pid_namespace)
        except OSError as error:
            control.send(_line({"done": request["seq"], "error": str(error)}))
            note.write(0, 0)
            continue
        finally:
            for fd in fds:
                os.close(fd)
        note.write(request["seq"], pid)
        _, wait_status = os.waitpid(pid, 0)
        if not spec["isolate"]:
            _reap_orphans()
        control.send(_line({"done": request["seq"], "wait_status": wait_status}))
        note.write(0, 0)


def _finish_for_dead_forker(control, note):
    """The forker was killed: its job's init is now our child. Wait for the job to end (its
    deadline bounds that), answer for it, and ask the host for a fresh server: a forker we
    made now would have no oom_score_adj floor."""
    seq, pid = note.read()
    wait_status = None
    while True:
        try:
            ended, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if ended == pid:
            wait_status = status
    if seq:
        fields = {"done": seq, "wait_status": wait_status, "restart": True}
        if wait_status is None:
            fields["error"] = "the slot's forker was killed before its job started"
        control.send(_line(fields))


def _reap_orphans(timeout_s=2.0):
    """Reduced mode: reap what of the job re-parented to us (killed, or dying), for at most
    `timeout_s`. With namespaces the kernel does this when the job's init dies."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.002)


def _become_pid_namespace_owner(control):
    """Continue in a child that is pid 1 of a pid namespace owned by our user namespace. bwrap
    made the slot's pid namespace from an outer user namespace, so we could not `setns` back
    into it after unsharing one for a job; from our own we can, which saves a fork per job.
    The parent stays as bwrap's pid 1 and only waits."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare the server's pid namespace")
    server_pid = os.fork()
    if server_pid == 0:
        return
    control.close()
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    _, wait_status = os.waitpid(server_pid, 0)
    os._exit(os.waitstatus_to_exitcode(wait_status) & 0xFF)


def _fork_job(request, fds, spec, control, own_pid_namespace):
    """Fork the job's init: pid 1 of a fresh pid namespace (isolate), or a child subreaper."""
    if spec["isolate"]:
        _check(_libc.unshare(CLONE_NEWPID), "unshare the job's pid namespace")
    try:
        pid = os.fork()
    except OSError:
        _restore_pid_namespace(own_pid_namespace)
        raise
    if pid == 0:
        _in_child(fds, lambda: (control.close(), _run_init(request, fds, spec)))
    _restore_pid_namespace(own_pid_namespace)
    return pid


def _restore_pid_namespace(own_pid_namespace):
    """The server's next children (the next job's init) are not in this job's namespace."""
    if own_pid_namespace is not None:
        _check(_libc.setns(own_pid_namespace, CLONE_NEWPID), "restore the pid namespace")


def _in_child(fds, body):
    """Run `body` in a forked child; never return into the server's loop from it."""
    try:
        body()
    except BaseException as error:
        _report_infra(fds[4], error)
    os._exit(EXIT_INFRA)


def _report_infra(status_fd, error):
    try:
        os.write(status_fd, _line({"infra": f"{type(error).__name__}: {error}"}))
    except Exception:
        pass


def _run_init(request, fds, spec):
    """Init of one job: prepare the filesystem, run the program, report how it ended."""
    stdin, stdout, stderr, report, status, files = fds
    # Before the program exists: as pid 1 we ignore default-action signals, but Python's own
    # SIGINT handler would raise KeyboardInterrupt here if the program signalled us early.
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    candidate = None
    try:
        if spec["isolate"]:
            _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare the job's namespaces")
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        else:
            _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
        _join_fresh_session_keyring()
        if spec["isolate"]:
            _mount_tmpfs("/tmp", request["tmp"], mode="1777")
            _mount("/tmp", "/dev/shm", None, MS_BIND)
            _mount_tmpfs("/work/job", request["job"], mode="0755")
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write("1000")  # as the forker's (the floor needs the host: root only)
        if request.get("candidate"):  # forked before the files exist: its memory never saw them
            candidate = _start_candidate(request, fds, spec)
        _write_files(files, request["job_dir"])
        os.close(files)
        if spec["isolate"]:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            _mount(None, "/work/job", None, flags)
        if candidate is not None:
            os.write(candidate[2], b"g")  # the files are in place and read-only: go
            os.close(candidate[2])
        program_pid = os.fork()
    except BaseException as error:
        _report_infra(status, error)
        os._exit(EXIT_INFRA)
    if program_pid == 0:
        extra = ((candidate[1].fileno(), FD_CANDIDATE),) if candidate is not None else ()
        _run_program(request, stdin, stdout, stderr, report, status, extra)
    if candidate is not None:
        candidate[1].close()
    for fd in (stdin, stdout, stderr, report):
        os.close(fd)
    ended = _reap_until(program_pid, candidate[0] if candidate is not None else None)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    final = {
        "exit": os.waitstatus_to_exitcode(ended[program_pid][0]),
        "full": _full_filesystem(request) if spec["isolate"] else None,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    if candidate is not None and candidate[0] in ended:
        wait_status, rusage = ended[candidate[0]]
        final["candidate_exit"] = os.waitstatus_to_exitcode(wait_status)
        final["candidate_cpu_s"] = rusage.ru_utime + rusage.ru_stime
    if not spec["isolate"]:
        _kill_descendants()
    os.write(status, _line(final))
    os._exit(0)


def _start_candidate(request, fds, spec):
    """Fork the candidate's process (judged jobs): pid 1 of a pid namespace of its own, so it
    can neither see nor signal the judge or init. It waits for init's go, then hides the
    judge's private directory under an empty mount and becomes a program like the judge, with
    fds 0-2 and the channel to the judge as fd 3 (no report, no status pipe, no job memfd).
    Returns (pid, the judge's end of the channel, the go pipe's write end)."""
    judge_end, candidate_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    go_read, go_write = os.pipe()
    own_pid_namespace = None
    if spec["isolate"]:
        own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        _check(_libc.unshare(CLONE_NEWPID), "unshare the candidate's pid namespace")
    try:
        pid = os.fork()
        if pid == 0:
            _run_candidate(request, fds, candidate_end.fileno(), go_read, spec)
    finally:
        _restore_pid_namespace(own_pid_namespace)
        if own_pid_namespace is not None:
            os.close(own_pid_namespace)
    candidate_end.close()
    os.close(go_read)
    return pid, judge_end, go_write


def _run_candidate(request, fds, channel, go, spec):
    try:
        stdin, stdout, stderr = fds[:3]
        table = ((stdin, FD_STDIN), (stdout, FD_STDOUT), (stderr, FD_STDERR), (channel, 3), (go, 4))
        _install_fds(table)  # every other fd (report, status, the job memfd) is closed here
        if os.read(4, 1) != b"g":  # init failed before its files were in place
            os._exit(EXIT_INFRA)
        os.close(4)
        os.setsid()  # out of init's process group: kill(0, ...) reaches only its own processes
        candidate = request["candidate"]
        if spec["isolate"]:
            _check(_libc.unshare(CLONE_NEWNS), "unshare the candidate's mount namespace")
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # its own pids only
            _mount(
                "tmpfs",
                candidate["hide"],
                "tmpfs",
                MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "size=4096,nr_inodes=2,mode=0555",
            )
        code, path = _become_program(request, candidate["main"])
    except BaseException:
        os._exit(EXIT_INFRA)
    _exec_main(code, path, request["args"])


def _join_fresh_session_keyring():
    """A new, empty, anonymous session keyring for this job, instead of the one inherited from
    the host (through bwrap and the server). The program's filter denies every keyring call,
    so this is what /proc/keys shows it, and all it could ever reach."""
    number = _SYS_KEYCTL.get(os.uname().machine)
    if number is None or _libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"join a fresh session keyring: {os.strerror(errno)}")


def _mount_tmpfs(target, caps, mode):
    options = f"size={caps['bytes']},nr_inodes={caps['inodes']},mode={mode}"
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options)


def _write_files(files_fd, job_dir):
    """The memfd holds the table's length (8 bytes), the table [(relative path, size), ...]
    (marshal), then the contents in order (job.py `pack`)."""
    with os.fdopen(os.dup(files_fd), "rb") as archive:
        archive.seek(0)
        table = marshal.loads(archive.read(int.from_bytes(archive.read(8), "little")))
        for name, size in table:
            path = os.path.join(job_dir, name)
            parent = os.path.dirname(path)
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o755)
            with open(path, "wb") as target:
                target.write(archive.read(size))
            os.chmod(path, 0o444)


def _reap_until(program_pid, candidate_pid=None):
    """Reap every child (orphans are re-parented to us) until the program itself is reaped;
    pid -> (wait status, rusage) of the program and, if it ended, the candidate. A candidate
    ends on its own once the judge has closed the channel (and so flushes its output): wait for
    that a moment; when the judge says its candidate is gone, wait for it until it ends (the
    host's deadline bounds that), since its wait status says who ended it."""
    ended = {}
    while program_pid not in ended:
        pid, wait_status, rusage = os.wait4(-1, 0)
        if pid in (program_pid, candidate_pid):
            ended[pid] = (wait_status, rusage)
    if candidate_pid is not None and candidate_pid not in ended:
        is_gone = os.waitstatus_to_exitcode(ended[program_pid][0]) == EXIT_CANDIDATE_GONE
        _await_exit(candidate_pid, None if is_gone else CANDIDATE_GRACE_S)
        pid, wait_status, rusage = os.wait4(candidate_pid, os.WNOHANG)
        if pid == candidate_pid:
            ended[pid] = (wait_status, rusage)
    return ended


def _await_exit(pid, timeout_s):
    import select

    pidfd = os.pidfd_open(pid)
    try:
        select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)


def _full_filesystem(request):
    """'inodes' or 'bytes' if the job's tmpfs ran out of that at the end of the run."""
    stats = os.statvfs("/tmp")
    if stats.f_ffree == 0:
        return "inodes"
    if stats.f_bavail * stats.f_frsize < request["tmp"]["slack_bytes"]:
        return "bytes"
    return None


def _kill_descendants():
    """Reduced mode: orphans re-parent to this subreaper; kill them in bounded rounds."""
    for _ in range(50):
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as children:
                pids = [int(pid) for pid in children.read().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _run_program(request, stdin, stdout, stderr, report, status, extra=()):
    """Become the program: fds, limits, no capabilities, marker, then main as `__main__`.
    `extra`: more (fd, target) pairs; a judged job's judge gets the candidate's channel."""
    try:
        table = ((stdin, FD_STDIN), (stdout, FD_STDOUT), (stderr, FD_STDERR),
                 (report, FD_REPORT), (status, FD_STATUS), *extra)  # fmt: skip
        _install_fds(table)
        if request.get("candidate"):  # the judge: no process may read its memory or fds
            _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")
        code, path = _become_program(request, request["main"])
    except _CompileError as error:
        os.write(FD_STATUS, _line({"compile_error": str(error)}))
        os._exit(1)
    except BaseException as error:
        _report_infra(FD_STATUS, error)
        os._exit(EXIT_INFRA)
    os.write(FD_STATUS, b'{"started": true}\n')
    os.close(FD_STATUS)
    _exec_main(code, path, request["args"])


class _CompileError(Exception):
    pass


def _install_fds(table):
    """Put each source fd on its target number and close every other fd."""
    for source, target in table:
        os.dup2(source, target + 100)  # via high numbers: a source may sit on a target
    for _, target in table:
        os.dup2(target + 100, target)
    os.closerange(max(target for _, target in table) + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _become_program(request, path):
    """cwd, rlimits, no capabilities, the syscall filter; then main's code, compiled."""
    os.chdir(request["cwd"])
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)  # as in a plain `python`
    for name, (soft, hard) in request["rlimits"].items():
        kind = getattr(resource, name)
        ceiling = resource.getrlimit(kind)[1]  # never raise: that needs a capability
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(kind, (soft, hard))
    _drop_capabilities()  # (`random` reseeds itself from os.urandom after every fork)
    _install_filter()
    with open(path, "rb") as source_file:
        source = source_file.read()
    try:
        return compile(source, path, "exec", dont_inherit=True), path
    except (SyntaxError, ValueError) as error:
        raise _CompileError(f"{type(error).__name__}: {error}") from None


def _exec_main(code, path, args):
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    main = type(sys)("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main  # so pickle and multiprocessing find the program's names
    try:
        exec(code, main.__dict__)
    except SystemExit as exit_request:
        _exit_like_python(exit_request.code)
    except BaseException:
        kind, value, trace = sys.exc_info()
        value.__traceback__ = trace.tb_next  # drop this frame: the traceback is main's alone
        sys.excepthook(kind, value, trace.tb_next)
        _flush_and_exit(1)
    _flush_and_exit(0)


def _exit_like_python(code):
    if code is None or isinstance(code, int):
        _flush_and_exit(code or 0)
    print(code, file=sys.stderr)
    _flush_and_exit(1)


def _flush_and_exit(code):
    """Exit as the interpreter would (atexit handlers, flushed streams), but never return
    into the server's or init's frames that this process was forked from."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # wait for non-daemon threads, as python does
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code & 0xFF)


class _FilterProgram(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]  # struct sock_fprog


def _install_filter():
    """The syscall filter (sandbox/seccomp.py, built by the host), for this process and all it
    makes; NoNewPrivs first, which a process without capabilities needs for it."""
    if _FILTER is None:
        raise PermissionError("no syscall filter in the server's spec")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")
    code = ctypes.create_string_buffer(_FILTER, len(_FILTER))
    program = _FilterProgram(len(_FILTER) // 8, ctypes.cast(code, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "seccomp")


def _drop_capabilities():
    """Clear the effective, permitted, inheritable and ambient sets, then check /proc: a
    program must never start with a capability (it could mount a tmpfs without limits)."""
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("CapInh", "CapPrm", "CapEff", "CapAmb") and int(value, 16) != 0:
                raise PermissionError(f"capability left after dropping: {line.strip()}")


if __name__ == "__main__":
    serve(marshal.loads(bytes.fromhex(sys.argv[1])))
