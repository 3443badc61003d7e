"""Runs inside the sandbox as the judge of an assert-style task (HumanEval's `check(candidate)`,
or assert statements): run each test source in the judge's process against a proxy of the entry point.

The judge's process holds the tests (/work/job/judge/tests.json) and the prompt
(/work/job/judge/prompt.py), both hidden from the candidate's process, and the report pipe (fd 3).
A test runs in a namespace made by executing the prompt alone (trusted: it is the task's, so
helpers such as HumanEval's `poly` or `encode_cyclic` are the task's own, never the
completion's), in which the entry point and `candidate` are a `Proxy`: each call goes to the
candidate's process as plain values and comes back as plain values (envs/code/sandbox_scripts/judge.py). A test
passes when it finishes without raising; if it defines `check`, `check(candidate)` is called.
One JSON line per test on fd 3: `{"i": index, "out": true}` or `{"i": index, "error": name}`.
Nothing the candidate does in its own process reaches the test, the comparison or the report.
NOT guaranteed: a test that uses a name the completion (not the prompt) defines fails, since
only the entry point crosses; a test that checks an argument was not mutated always passes.
Not standalone-safe: run only inside the sandbox.
"""

import json
import sys

import gapless_judge as judge


def prompt_namespace(prompt: str, proxy: judge.Proxy) -> dict:
    """The prompt's own names (helpers, imports), with the entry point bound to the proxy."""
    namespace = {"__name__": "prompt"}
    for source in (prompt, prompt + "pass\n", prompt + "\n    pass\n"):
        try:
            code = compile(source, "prompt.py", "exec")
        except (SyntaxError, ValueError):
            continue
        try:
            exec(code, namespace)
        except Exception:  # noqa: BLE001 -- a prompt that does not run alone gives no helpers
            namespace = {"__name__": "prompt"}
        break
    namespace[proxy.__name__] = proxy
    return namespace


def main() -> None:
    report = judge.open_report()
    tests = json.loads(judge.read_private("tests.json"))
    prompt = judge.read_private("prompt.py")
    candidate = judge.connect(report)
    proxy = judge.Proxy(candidate, sys.argv[1])
    helpers = prompt_namespace(prompt, proxy)
    for index, test in enumerate(tests):
        scope = dict(helpers, candidate=proxy)
        try:
            exec(compile(test, f"test_{index}.py", "exec"), scope)
            if callable(scope.get("check")) and scope.get("check") is not helpers.get("check"):
                scope["check"](proxy)
            line = json.dumps({"i": index, "out": True})
        except judge.CandidateGone:
            sys.exit(judge.EXIT_CANDIDATE_GONE)
        except BaseException as exc:  # noqa: BLE001 -- a failing test (even SystemExit) is that test's result
            line = json.dumps({"i": index, "error": type(exc).__name__})
        report.write(line + "\n")


main()
