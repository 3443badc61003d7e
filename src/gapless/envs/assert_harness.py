"""Runs inside the sandbox: load the candidate program, run each test source against its entry point.

A test source is a few statements (typically `assert` lines) that may use `candidate` (the entry
point) and the program's own names; if it defines `check`, `check(candidate)` is called as in
HumanEval. A test passes when it finishes without raising. One JSON line per test goes to file
descriptor 3, a pipe the host opened: `{"i": index, "out": true}` for a pass, `{"i": index,
"error": name}` otherwise. Tests run in order in one process, so a test that hangs or exhausts a
limit ends the program and leaves the later tests unreported (the host counts them as failed).
Not standalone-safe: run only inside the sandbox (it executes untrusted code).
"""

import json
import os
import sys


def main() -> None:
    report = os.fdopen(3, "w", buffering=1)
    with open("/work/job/tests.json") as fh:
        tests = json.load(fh)
    with open("/work/job/solution.py") as fh:
        source = fh.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        report.write(json.dumps({"compile_error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.exit(3)
    namespace = {"__name__": "solution"}
    exec(code, namespace)
    entry = namespace[sys.argv[1]]
    for index, test in enumerate(tests):
        scope = dict(namespace, candidate=entry)
        try:
            exec(compile(test, f"test_{index}.py", "exec"), scope)
            if callable(scope.get("check")) and scope.get("check") is not namespace.get("check"):
                scope["check"](entry)
            line = json.dumps({"i": index, "out": True})
        except BaseException as exc:  # noqa: BLE001 -- a failing test (even SystemExit) is that test's result
            line = json.dumps({"i": index, "error": type(exc).__name__})
        report.write(line + "\n")


main()
