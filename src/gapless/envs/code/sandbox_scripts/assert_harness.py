"""Runs inside the sandbox as the judge of an assert-style task (HumanEval's `check(candidate)`,
or assert statements): run each test source in the judge's process against a proxy of the entry point.

The judge's process holds the tests (/work/job/judge/tests.json) and the prompt
(/work/job/judge/prompt.py), both hidden from the candidate's process, and the report pipe (fd 3).
A test runs in a namespace made by executing the prompt alone (trusted: it is the task's, so
helpers such as HumanEval's `poly` or `encode_cyclic` are the task's own, never the
completion's), in which the entry point and `candidate` are a `Proxy`: each call goes to the
candidate's process as plain values and comes back as plain values (envs/code/sandbox_scripts/judge.py). A test
passes when it finishes without raising and no call to the candidate failed during it (a failed
call raises `CandidateFailed` and is recorded, so a test whose code swallows the exception, e.g.
a `StopIteration` that would end a `map` early, still fails: the judge runs the test's control
flow, never the candidate's); if it defines `check`, `check(candidate)` is called.
One JSON line per test on fd 3: `{"i": index, "out": true}` or `{"i": index, "error": name}`.
Nothing the candidate does in its own process reaches the test, the comparison or the report.
NOT guaranteed: a test that uses a name the completion (not the prompt) defines fails, since
only the entry point crosses; a test that checks an argument was not mutated always passes; a
test that expects the entry point to raise always fails.
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
        report.write(json.dumps(run_test(index, test, helpers, proxy, candidate)) + "\n")


def run_test(index: int, test: str, helpers: dict, proxy: judge.Proxy, candidate: judge.Candidate) -> dict:
    """One test's record. It passes only if it finished without raising AND no call to the
    candidate failed meanwhile: what the test's code did with a failed call's exception (caught
    it, lost it in a `map` or a generator, suppressed it) does not matter."""
    scope = dict(helpers, candidate=proxy)
    candidate.begin_test()
    error = None
    try:
        exec(compile(test, f"test_{index}.py", "exec"), scope)
        if callable(scope.get("check")) and scope.get("check") is not helpers.get("check"):
            scope["check"](proxy)
    except judge.CandidateGone:
        sys.exit(judge.EXIT_CANDIDATE_GONE)
    except BaseException as exc:  # noqa: BLE001 -- a failing test (even SystemExit) is that test's result
        error = type(exc).__name__
    if candidate.is_gone:  # the test swallowed `CandidateGone`
        sys.exit(judge.EXIT_CANDIDATE_GONE)
    if candidate.failure is not None:
        error = f"candidate: {candidate.failure}"
    return {"i": index, "out": True} if error is None else {"i": index, "error": error}


main()
