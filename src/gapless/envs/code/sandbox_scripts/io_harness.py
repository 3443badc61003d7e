"""Runs inside the sandbox as the judge of an input/output task: call the candidate's `f` on each
hidden input, report its output.

The judge's process holds the inputs (/work/job/judge/tests.json, hidden from the candidate's
process) and the report pipe (fd 3); the candidate's process answers calls with plain values
(envs/code/sandbox_scripts/judge.py). One JSON line per test: `{"i": index, "out": output}` or `{"i": index,
"error": name}`; with the argument `typed` (host-compared asserts, envs/code/asserts.py) the
inputs are typed plain values, one per line, and each result is reported as `{"i": index,
"value": <its typed encoding>}`. The judge never sees the expected outputs either: the host compares them, so
nothing the candidate does, in its process or in its answers, passes a test it did not solve.
Not standalone-safe: run only inside the sandbox.
"""

import json
import sys

import gapless_judge as judge
import gapless_values as values


def main() -> None:
    report = judge.open_report()
    is_typed = sys.argv[2:] == ["typed"]  # host-compared asserts: typed arguments and results
    text = judge.read_private("tests.json")
    inputs = [values.decode(line) for line in text.splitlines()] if is_typed else json.loads(text)
    candidate = judge.connect(report)
    entry = sys.argv[1]
    for index, args in enumerate(inputs):
        candidate.begin_test()
        try:
            out = candidate.call(entry, tuple(args), {})
            if is_typed:
                line = json.dumps({"i": index, "value": values.encode(out)})
            else:
                line = json.dumps({"i": index, "out": out}, sort_keys=True)
        except judge.CandidateGone:
            sys.exit(judge.EXIT_CANDIDATE_GONE)
        except judge.CandidateFailed:  # the candidate's failure on one test is that test's result
            line = json.dumps({"i": index, "error": candidate.failure})
        except Exception as exc:  # a result with no JSON or typed form
            line = json.dumps({"i": index, "error": type(exc).__name__})
        report.write(line + "\n")


main()
