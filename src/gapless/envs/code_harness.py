"""Runs inside the sandbox: import the candidate's `f`, call it on each hidden input, report outputs.

Outputs go, one JSON line per test, to file descriptor 3, a pipe the host opened. The harness
never sees the expected outputs: the host compares them, so a program that exits early, prints
fake results or writes to fd 3 itself cannot pass a test it did not solve.
Not standalone-safe: run only inside the sandbox (it executes untrusted code).
"""

import json
import os
import sys


def main() -> None:
    report = os.fdopen(3, "w", buffering=1)
    with open("/work/job/tests.json") as fh:
        inputs = json.load(fh)
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
    for index, args in enumerate(inputs):
        try:
            line = json.dumps({"i": index, "out": entry(*args)}, sort_keys=True)
        except Exception as exc:  # the candidate's failure on one test is that test's result
            line = json.dumps({"i": index, "error": type(exc).__name__})
        report.write(line + "\n")


main()
