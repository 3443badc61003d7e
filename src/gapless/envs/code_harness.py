"""Runs inside the sandbox as the judge of an input/output task: call the candidate's `f` on each
hidden input, report its output.

The judge's process holds the inputs (/work/job/judge/tests.json, hidden from the candidate's
process) and the report pipe (fd 3); the candidate's process answers calls with plain values
(code_judge.py). One JSON line per test: `{"i": index, "out": output}` or `{"i": index,
"error": name}`. The judge never sees the expected outputs either: the host compares them, so
nothing the candidate does, in its process or in its answers, passes a test it did not solve.
Not standalone-safe: run only inside the sandbox.
"""

import json
import sys

import gapless_judge as judge


def main() -> None:
    report = judge.open_report()
    inputs = json.loads(judge.read_private("tests.json"))
    candidate = judge.connect(report)
    entry = sys.argv[1]
    for index, args in enumerate(inputs):
        try:
            line = json.dumps({"i": index, "out": candidate.call(entry, tuple(args), {})}, sort_keys=True)
        except judge.CandidateGone:
            sys.exit(judge.EXIT_CANDIDATE_GONE)
        except Exception as exc:  # the candidate's failure on one test is that test's result
            line = json.dumps({"i": index, "error": type(exc).__name__})
        report.write(line + "\n")


main()
