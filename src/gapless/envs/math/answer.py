"""Math answers: math-verify's own extraction and verification, plus gapless's named additions.

`grade(reference, completion)` returns (reward, status), reward 1.0 only for "ok". By default it is
math-verify's pipeline as its README runs it: `verify(parse("\\boxed{reference}"), parse(completion))`
-- math-verify extracts the answer from the whole completion itself (a `\\boxed{}`, several boxes
read as the set of their contents, "final answer is", "answer:", else the last expression), and
compares with sympy (numbers, fractions, LaTeX, sets, intervals ...). Statuses:
    ok            math-verify finds an extracted answer equivalent to the reference
    wrong_answer  math-verify read an answer (an expression, not just text) that is not equivalent
    no_answer     math-verify found nothing that reads as an answer (empty, words only, unclosed box)
    parse_error   it found only text it could not read as mathematics (`\\boxed{90°}`)
    timeout       parsing or comparing took longer than `timeout_s` (default 5 s, math-verify's
                  own; e.g. 10^10^10^10); there is no character cap: a long correct answer is
                  parsed, bounded by time
    grader_crash  the helper process (below) died grading this answer, and a fresh one did too:
                  the answer's doing, scored 0; infra_error only when a fresh helper cannot
                  grade a trusted probe ("1" against "1") either: the answer never decides it
gapless's additions (`lenient=True`, config `task.math_lenient`, off by default): only when
math-verify reads no answer at all (no_answer or parse_error), gapless's own extraction is tried --
the last balanced `\\boxed{...}`, else the text after the last "answer:" in any case and spacing
(`ANSWER:42`, which math-verify does not read), else, when the prompt itself ends with "Answer:",
the completion's first line -- read as LaTeX or as a plain expression (`\\boxed{90°}` reads as 90).
An addition can only turn that no_answer or parse_error into ok: it never overrides an answer
math-verify read, so where math-verify says wrong_answer, gapless does too.
Model output is untrusted: grading never raises because of it (any exception of math-verify or
sympy is a failed parse or a failed comparison). math-verify bounds its time with SIGALRM, which
works only in the main thread; called from any other thread, `grade` runs in a helper process
(started once with subprocess, so from a daemonic pipeline actor too; killed and restarted when
it overruns) so a hostile answer cannot hang a
scorer thread either.
Not guaranteed: that math-verify's notion of equivalence is the data set's (it is generous with
formats, strict with units and text), that a regular expression stuck inside C code is interrupted
by the alarm in the main thread (the helper-process path has a hard deadline), or that a
helper-process answer is as fast as in-thread.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading

MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own default for parse and verify: the same bound as the peer
_ANSWER_MARK = re.compile(r"answer\s*:", re.IGNORECASE)
_helper: subprocess.Popen | None = None
_helper_lock = threading.Lock()


def extract_answer(completion: str, prompt_ends_with_answer: bool = False) -> str | None:
    """gapless's own extraction (used by the additions): last box, else after "answer:", else the first line."""
    if "\\boxed{" in completion:  # a box decides, even an unclosed one (then there is no answer)
        boxed = _last_boxed(completion)
        return (boxed.strip() or None) if boxed is not None else None
    marks = list(_ANSWER_MARK.finditer(completion))
    if marks:
        tail = completion[marks[-1].end() :].strip()
    elif prompt_ends_with_answer:
        tail = completion.strip()
    else:
        return None
    line = tail.splitlines()[0].strip().rstrip(".") if tail else ""
    return line or None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unclosed: no answer was finished


def grade(
    reference: str,
    completion: str,
    prompt_ends_with_answer: bool = False,
    timeout_s: int = MATH_VERIFY_TIMEOUT_S,
    lenient: bool = False,
) -> tuple[float, str]:
    if threading.current_thread() is threading.main_thread():
        return grade_here(reference, completion, prompt_ends_with_answer, timeout_s, lenient)
    return _grade_in_helper(reference, completion, prompt_ends_with_answer, timeout_s, lenient)


def grade_here(
    reference: str,
    completion: str,
    prompt_ends_with_answer: bool = False,
    timeout_s: int = MATH_VERIFY_TIMEOUT_S,
    lenient: bool = False,
) -> tuple[float, str]:
    """math-verify with its signal timeouts; main thread of a process only."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout_s)  # trusted data
    try:
        found = parse(completion, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        return 0.0, "timeout"
    except Exception:  # noqa: BLE001 -- math-verify itself reads a failed parse as "nothing found"
        found = []
    equivalent, timed_out = _verify(gold, found, timeout_s)
    if equivalent:
        return 1.0, "ok"
    is_read = any(not isinstance(f, str) for f in found)
    if not is_read and lenient and _addition_is_equivalent(gold, completion, prompt_ends_with_answer, timeout_s):
        return 1.0, "ok"
    if timed_out:
        return 0.0, "timeout"
    return 0.0, "wrong_answer" if is_read else "parse_error" if found else "no_answer"


def _verify(gold: list, found: list, timeout_s: int) -> tuple[bool, bool]:
    """math-verify's `verify` pair by pair in its own order (it is `any` over gold x found), so a
    timeout on one pair is seen without hiding a later pair that matches: (equivalent, timed out)."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timed_out = False
    for g in gold:
        for f in found:
            try:
                if verify(g, f, timeout_seconds=timeout_s, raise_on_error=True):
                    return True, timed_out
            except TimeoutException:
                timed_out = True
            except Exception:  # noqa: BLE001 -- whatever sympy makes of untrusted text is "not equal"
                pass
    return False, timed_out


def _addition_is_equivalent(gold: list, completion: str, prompt_ends_with_answer: bool, timeout_s: int) -> bool:
    from math_verify import parse
    from math_verify.errors import TimeoutException

    answer = extract_answer(completion, prompt_ends_with_answer)
    if answer is None:
        return False
    try:
        parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s, raise_on_error=True)
        if not any(not isinstance(p, str) for p in parsed):
            parsed = parse(answer, parsing_timeout=timeout_s, raise_on_error=True)
    except (TimeoutException, Exception):  # noqa: BLE001 -- no reading, no rescue
        return False
    return _verify(gold, [p for p in parsed if not isinstance(p, str)], timeout_s)[0]


def _grade_in_helper(
    reference: str, completion: str, follows: bool, timeout_s: int, lenient: bool
) -> tuple[float, str]:
    """Off the main thread: the same grading in a helper process, with a hard deadline. A helper
    that dies grading an answer, and dies again on it when fresh, was killed by that answer
    (`grader_crash`, reward 0) unless a fresh one cannot grade a trusted probe either (infra_error):
    the answer alone never makes a rollout infra_error."""
    request = [reference, completion, follows, timeout_s, lenient]
    with _helper_lock:  # one answer at a time, as one helper grades them
        for _attempt in range(2):
            verdict = _ask_helper(request)
            if verdict != "died":
                return (0.0, "timeout") if verdict == "overran" else verdict
        if _ask_helper(["1", "1", False, timeout_s, False]) == (1.0, "ok"):
            return 0.0, "grader_crash"
        return 0.0, "infra_error"  # the helper cannot grade at all: no verdict, no reward signal


def _ask_helper(request: list) -> tuple[float, str] | str:
    """One request to the helper (started if needed): its verdict, "overran" or "died"; a helper
    that overran or died is killed and the next request starts a new one. Holds `_helper_lock`."""
    global _helper
    if _helper is None or _helper.poll() is not None:
        _helper = _start_helper()
    helper, timeout_s = _helper, request[3]
    try:
        helper.stdin.write(json.dumps(request) + "\n")
        helper.stdin.flush()
        ready, _, _ = select.select([helper.stdout], [], [], 6 * timeout_s + 30)  # at most five bounded calls
        line = helper.stdout.readline() if ready else None
    except (BrokenPipeError, OSError, ValueError):
        line = ""
    if line:
        try:
            reward, status = json.loads(line)
            return float(reward), str(status)
        except (ValueError, TypeError):
            line = ""
    helper.kill()  # overran (math-verify's own alarm did not fire) or died: a new one next time
    helper.wait()
    _helper = None
    return "overran" if line is None else "died"


def _start_helper() -> subprocess.Popen:
    """`python -m gapless.envs.math.answer`: started with subprocess, not multiprocessing, so that a
    daemonic process (a pipeline actor) can start it too; it imports gapless from this sys.path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen(
        [sys.executable, "-m", "gapless.envs.math.answer"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _serve() -> None:
    """The helper's loop: one JSON request per line in, one [reward, status] line out, graded in
    this process's main thread (so math-verify's alarms work)."""
    for line in sys.stdin:
        reference, completion, follows, timeout_s, lenient = json.loads(line)  # the host's own request
        print(json.dumps(grade_here(reference, completion, follows, timeout_s, lenient)), flush=True)


if __name__ == "__main__":
    _serve()
