"""Math answers: find the model's final answer and check it against the reference with math-verify.

`extract_answer` takes the last `\\boxed{...}` (braces balanced), else the text after the last
"Answer:", else -- when the prompt itself ends with "Answer:" -- the completion's first line.
`grade(reference, completion)` returns (reward, status), reward 1.0 only for "ok":
    ok            equivalent to the reference (math-verify: numbers, fractions, LaTeX, sets, ...)
    wrong_answer  an answer that parses and is not equivalent
    no_answer     nothing that looks like a final answer (no box, no "Answer:", empty)
    parse_error   an answer math-verify cannot read, or longer than MAX_ANSWER_CHARS
    timeout       parsing or comparing took longer than `timeout_s` (e.g. 10^10^10^10)
Model output is untrusted: grading never raises because of it (any exception of math-verify or
sympy becomes parse_error). math-verify bounds its own time with SIGALRM, which works only in the
main thread; called from any other thread, `grade` runs the check in a helper process (started
once, spawned, killed and restarted when it overruns) so a hostile answer cannot hang a scorer
thread either.
Not guaranteed: that math-verify's notion of equivalence is the data set's (it is generous with
formats, strict with units and text), or that a helper-process answer is as fast as in-thread.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

MAX_ANSWER_CHARS = 200
_ANSWER_MARK = re.compile(r"answer\s*:", re.IGNORECASE)
_helper: ProcessPoolExecutor | None = None
_helper_lock = threading.Lock()


def extract_answer(completion: str, prompt_ends_with_answer: bool = False) -> str | None:
    if "\\boxed{" in completion:  # a box decides, even an unclosed one (then there is no answer)
        boxed = _last_boxed(completion)
        return (boxed.strip() or None) if boxed is not None else None
    marks = list(_ANSWER_MARK.finditer(completion))
    if marks:
        tail = completion[marks[-1].end():].strip()
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


def grade(reference: str, completion: str, prompt_ends_with_answer: bool = False, timeout_s: int = 3) -> tuple[float, str]:
    answer = extract_answer(completion, prompt_ends_with_answer)
    if answer is None:
        return 0.0, "no_answer"
    if len(answer) > MAX_ANSWER_CHARS:
        return 0.0, "parse_error"
    if threading.current_thread() is threading.main_thread():
        return check_equivalent(reference, answer, timeout_s)
    return _check_in_helper(reference, answer, timeout_s)


def check_equivalent(reference: str, answer: str, timeout_s: int = 3) -> tuple[float, str]:
    """math-verify with its signal timeouts; main thread of a process only."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout_s, raise_on_error=True)
        parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s, raise_on_error=True)
        if not parsed or not any(not isinstance(p, str) for p in parsed):
            parsed = parse(answer, parsing_timeout=timeout_s, raise_on_error=True)
        if not parsed:
            return 0.0, "parse_error"
        ok = verify(gold, parsed, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException:
        return 0.0, "timeout"
    except Exception:  # noqa: BLE001 -- whatever sympy makes of untrusted text is a parse failure
        return 0.0, "parse_error"
    return (1.0, "ok") if ok else (0.0, "wrong_answer")


def _check_in_helper(reference: str, answer: str, timeout_s: int) -> tuple[float, str]:
    """Off the main thread: the same check in a spawned helper process, with a hard deadline."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        helper = _helper
    try:
        return helper.submit(check_equivalent, reference, answer, timeout_s).result(timeout=3 * timeout_s + 30)
    except FutureTimeout:  # math-verify's own alarm did not fire: kill the helper, start a new one next time
        _discard(helper)
        return 0.0, "timeout"
    except BrokenProcessPool:  # the helper died (it is restarted): no verdict, so no reward signal
        _discard(helper)
        return 0.0, "infra_error"


def _discard(helper: ProcessPoolExecutor) -> None:
    global _helper
    with _helper_lock:
        if _helper is helper:
            _helper = None
    for process in list((getattr(helper, "_processes", None) or {}).values()):  # private, but the only handle
        process.kill()
    helper.shutdown(wait=False, cancel_futures=True)
