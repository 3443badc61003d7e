"""Bootstrap that runs inside the sandbox, before the program: `python -I -B -c <this file>`.

The host passes this file's source with `-c`, then a JSON spec, the program's path and its
arguments. bwrap starts it as pid 1 of the run's pid namespace (`--as-pid-1`). In order:
1. apply the spec's rlimits (soft and hard), so they bind the program and all its children but
   not bwrap itself, and read the program's source (an unreadable job is the sandbox's fault);
2. fork. The parent stays pid 1 and only reaps: orphans of the program, then the program, whose
   exit status becomes its own (128 + N for death by signal N); its exit makes the kernel kill
   whatever is left in the namespace. The child goes on as the program;
3. the child writes one byte to the start-marker fd and closes it: from here on a failure is the
   program's, before it the sandbox's (the program never holds that fd, so it cannot forge it);
4. moves the report pipe to fd 3;
5. runs the program as `__main__` with `sys.argv = [path, *args]` and `sys.path[0]` = its
   directory, as `python path args` would (`-I` alone would leave the directory off sys.path).

Why our own pid 1 rather than bwrap's: bwrap's monitor exits as soon as its init reports the
program's exit, orphaning that init; its zombie then waits for the host's pid 1 (measured here:
about a second) while counting against the slot uid's RLIMIT_NPROC. Ours is reaped by the
monitor. The program is not pid 1 either, so SIGXCPU and self-sent signals behave normally.

Importing this module does nothing. It uses only the standard library of the sandbox's python.
NOT guaranteed: identical tracebacks; they start with one extra frame, `File "<string>"`.
"""

import json
import os
import resource
import signal
import sys
import types

REPORT_FD = 3


def _stay_init_unless_child(spec: dict) -> None:
    """Fork; return in the child, reap and exit in the parent (pid 1)."""
    program_pid = os.fork()
    if program_pid == 0:
        return
    os.close(spec["started_fd"])
    os.close(spec["report_fd"])
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-action signals
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == program_pid:
            exit_code = os.waitstatus_to_exitcode(status)
            os._exit(exit_code if exit_code >= 0 else 128 - exit_code)


def _prepare() -> types.CodeType:
    spec = json.loads(sys.argv[1])
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    path = sys.argv[2]
    with open(path, "rb") as source_file:
        source = source_file.read()
    _stay_init_unless_child(spec)
    os.write(spec["started_fd"], b"1")
    os.close(spec["started_fd"])
    if spec["report_fd"] != REPORT_FD:
        os.dup2(spec["report_fd"], REPORT_FD)
        os.close(spec["report_fd"])
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(path))
    main = types.ModuleType("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main  # so pickle and multiprocessing find the program's names
    return compile(source, path, "exec", dont_inherit=True)


if __name__ == "__main__":
    exec(_prepare(), sys.modules["__main__"].__dict__)
