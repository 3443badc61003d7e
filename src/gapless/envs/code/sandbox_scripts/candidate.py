"""Runs inside the sandbox, in the candidate's process: load the completion, answer the judge's calls.

This process holds no test, no report channel and no comparison (envs/code/sandbox_scripts/judge.py says who does).
It says `up` on fd 3 and waits for the judge's `go` (the handshake in envs/code/sandbox_scripts/judge.py: no code of
the completion runs before the judge has started), then loads /work/job/solution.py (prompt +
completion), says `ready` (or its compile error), then answers each call `[number, name, args, kwargs]` with `[number, "r", result]` or
`[number, "e", exception name]`, one line of JSON each (envs/code/values.py). A result with no
plain-data form is the error `Unrepresentable`.
Once the completion's code has run, nothing here can be trusted, and nothing needs to be: the
judge reads the answers only through `decode`, and an answer is only ever the candidate's answer.
Not standalone-safe: run only inside the sandbox (it executes untrusted code).
"""

import sys

import gapless_values as values

FD_CHANNEL = 3


def main() -> None:
    channel = values.LineChannel(FD_CHANNEL)
    channel.send(values.encode(["up"]))
    if channel.receive() is None:  # the judge is gone
        return
    with open("/work/job/solution.py", encoding="utf-8") as handle:
        source = handle.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        channel.send(values.encode(["compile_error", f"{type(exc).__name__}: {exc}"]))
        sys.exit(3)
    namespace = {"__name__": "solution"}
    exec(code, namespace)  # an exception here ends the process: the judge sees the channel close
    channel.send(values.encode(["ready"]))
    while True:
        line = channel.receive()
        if line is None:
            return
        channel.send(answer(namespace, line))


def answer(namespace: dict, line: bytes) -> str:
    try:
        number, name, args, kwargs = values.decode(line)
    except (values.Malformed, TypeError, ValueError):
        return values.encode([0, "e", "Malformed"])
    try:
        result = namespace[name](*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 -- even SystemExit in a call is that call's result
        return values.encode([number, "e", type(exc).__name__])
    try:
        return values.encode([number, "r", result])
    except values.Unrepresentable:
        return values.encode([number, "e", "Unrepresentable"])


main()
