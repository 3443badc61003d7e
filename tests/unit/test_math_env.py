"""Math environment: answer extraction and math-verify equivalence, by table, including hostile output."""

import random
import threading

import pytest

from gapless.envs.math.answer import extract_answer, grade
from gapless.envs.math.environment import MathEnvironment, load_math_dataset
from gapless.envs.math.problems import generate_math_problems, left_to_right
from gapless.envs.records import DatasetError
from gapless.types import Completion

LONG = "+".join(f"{i}x^{{{i}}}" for i in range(1, 40))  # a correct answer of 300+ characters


@pytest.mark.parametrize(
    "reference, completion, follows_prompt, reward, status",
    [
        ("11", "11", True, 1.0, "ok"),
        ("11", " 11.\nmore text", True, 1.0, "ok"),
        ("11", "14", True, 0.0, "wrong_answer"),
        ("11", "so the value is \\boxed{11}", False, 1.0, "ok"),
        (
            "11",
            "\\boxed{3} then \\boxed{11}",
            False,
            0.0,
            "wrong_answer",
        ),  # several boxes: math-verify reads the set {3, 11}
        ("\\{3, 11\\}", "\\boxed{3} and \\boxed{11}", False, 1.0, "ok"),
        ("11", "Answer: 11", False, 1.0, "ok"),
        ("11", "the sum is 11", False, 1.0, "ok"),  # math-verify reads the last expression without any anchor
        ("7", "Answer: the value is 7", False, 1.0, "ok"),  # words are not a product of symbols
        ("11", "", True, 0.0, "no_answer"),
        ("11", "\\boxed{", False, 0.0, "no_answer"),  # unclosed box
        ("11", "\\boxed{11", False, 0.0, "no_answer"),
        ("11", "\\boxed{}", False, 0.0, "no_answer"),
        ("\\frac{1}{2}", "\\boxed{0.5}", False, 1.0, "ok"),
        ("0.5", "1/2", True, 1.0, "ok"),
        ("-3", "-3", True, 1.0, "ok"),
        ("-3", "3", True, 0.0, "wrong_answer"),
        ("11", "abc", True, 0.0, "no_answer"),
        ("11", "é中😀", True, 0.0, "no_answer"),
        ("11", "\\boxed{é中😀}", False, 0.0, "parse_error"),
        ("11", "9" * 100, True, 0.0, "wrong_answer"),  # a huge number is just wrong
        ("11", "\\boxed{\\frac{1}{0}}", False, 0.0, "wrong_answer"),  # zoo is not 11
        ("11", "x" * 10_000, True, 0.0, "no_answer"),
        ("11", "\x00\x01\\\\}}{{", True, 0.0, "no_answer"),
        (LONG, f"The expansion is \\boxed{{{LONG}}}", False, 1.0, "ok"),  # no character cap on a correct answer
    ],
)
def test_grade_table(reference, completion, follows_prompt, reward, status):
    assert grade(reference, completion, follows_prompt) == (reward, status)


@pytest.mark.parametrize(
    "reference, completion, peer_status",
    [
        ("42", "ANSWER:42", "no_answer"),  # math-verify reads nothing without a space after the colon
        ("90", "\\boxed{90°}", "parse_error"),  # math-verify cannot read the degree sign
        ("11", "Answer:11", "no_answer"),
    ],
)
def test_the_named_additions_turn_what_math_verify_cannot_read_into_ok(reference, completion, peer_status):
    assert grade(reference, completion) == (0.0, peer_status)
    assert grade(reference, completion, lenient=True) == (1.0, "ok")


@pytest.mark.parametrize(
    "reference, completion, status",
    [
        ("11", "\\boxed{3} then \\boxed{11}", "wrong_answer"),  # math-verify read the set {3, 11}: no rescue
        ("11", "Answer: 12\n11", "wrong_answer"),
        ("11", "Answer: the value is", "no_answer"),  # words are not rescued as a product of symbols
    ],
)
def test_the_additions_never_override_what_math_verify_read(reference, completion, status):
    assert grade(reference, completion, lenient=True) == (0.0, status)


def test_work_is_bounded_by_time():
    assert grade("11", "10^10^10^10", True, timeout_s=1) == (0.0, "timeout")


def test_extract_answer_takes_balanced_braces():
    assert extract_answer("\\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("Answer: 7. Because") == "7. Because"
    assert extract_answer("answer : 7\n8") == "7"


def test_grading_off_the_main_thread_uses_the_helper_process():
    results = {}

    def worker():
        results["ok"] = grade("11", "11", True)
        results["wrong"] = grade("11", "\\boxed{12}")
        results["addition"] = grade("42", "ANSWER:42", lenient=True)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=120)
    assert results == {"ok": (1.0, "ok"), "wrong": (0.0, "wrong_answer"), "addition": (1.0, "ok")}


def test_procedural_problems_and_teacher_habit():
    train = generate_math_problems(0, "train", 300, [1, 2, 3])
    evalset = generate_math_problems(0, "eval", 30, [1, 2, 3])
    assert len(train) == 300 and not {t.prompt for t in train} & {t.prompt for t in evalset}
    assert train == generate_math_problems(0, "train", 300, [1, 2, 3])
    assert left_to_right("3+4*2") == 14 and left_to_right("(1+2)*3") == 9
    assert all(t.mistake == t.answer for t in train if t.level < 3)
    assert any(t.mistake != t.answer for t in train if t.level == 3)
    env = MathEnvironment({"train": train})
    task = train[0]
    groups = env.score_groups([task], [[_completion(task.answer), _completion("é中"), _completion(task.answer)]])
    assert [(r.reward, r.status) for r in groups[0]] == [(1.0, "ok"), (0.0, "no_answer"), (1.0, "ok")]


def test_math_dataset_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"prompt": "What is half of one? Put it in \\\\boxed{}.", "answer": "\\\\frac{1}{2}", "split": "eval"}\n'
        '{"prompt": "2+2?", "answer": 4, "split": "train"}\n'
    )
    splits = load_math_dataset(path)
    assert [t.answer for t in splits["eval"]] == ["\\frac{1}{2}"]
    path.write_text('{"prompt": "2+2?", "answer": 4}\n{"prompt": "x", "answer": null}\n{"answer": "3"}\n')
    with pytest.raises(DatasetError, match=r"m.jsonl:2: field 'answer'.*m.jsonl:3: missing field 'prompt'"):
        load_math_dataset(path)


def _completion(text):
    return Completion([], [], [], [], "stop", text)


REFERENCES = [
    "11",
    "-3",
    "0",
    "42",
    "1000000",
    "\\frac{1}{2}",
    "-\\frac{7}{3}",
    "0.25",
    "3.14",
    "\\sqrt{2}",
    "2\\sqrt{3}",
    "\\pi",
    "x^2+1",
    "2x-5",
    "\\{1, 2\\}",
    "(1, 3)",
    "[0, 1]",
    "\\frac{\\pi}{4}",
    "10^6",
    "e^2",
]
EQUIVALENT = {
    "11": "11.0",
    "0": "-0",
    "42": "42.00",
    "1000000": "10^6",
    "\\frac{1}{2}": "0.5",
    "-\\frac{7}{3}": "-7/3",
    "0.25": "\\frac{1}{4}",
    "\\sqrt{2}": "2^{1/2}",
    "x^2+1": "1+x^2",
    "2x-5": "-5+2x",
    "\\{1, 2\\}": "\\{2, 1\\}",
    "10^6": "1000000",
    "\\frac{\\pi}{4}": "\\frac{1}{4}\\pi",
}


def math_completions(answer: str, other: str, rng: random.Random) -> list[str]:
    """Correct, wrong, malformed, multi-line, tagged, huge and adversarial completions for one reference."""
    steps = "\n".join(
        f"Step {i}: {rng.randint(2, 99)} + {rng.randint(2, 99)} = {rng.randint(2, 200)}"
        for i in range(rng.randint(1, 4))
    )
    same = EQUIVALENT.get(answer, answer)
    return [
        answer,
        f"\\boxed{{{answer}}}",
        f"The answer is ${answer}$.",
        f"Answer: {answer}",
        f"{steps}\nSo the final answer is \\boxed{{{answer}}}.",
        f"{steps}\nTherefore, the final answer is: ${same}$",
        f"\\boxed{{{same}}}",
        f"\\boxed{{{other}}}",
        f"{steps}\nAnswer: {other}",
        f"\\boxed{{{other}}} and then \\boxed{{{answer}}}",  # several boxes
        f"\\boxed{{{answer}}} \\boxed{{{answer}}}",
        f"First I thought \\boxed{{{other}}}.\nOn reflection:\n$$\n{answer}\n$$",
        f"\\boxed{{{answer}",  # unclosed
        "\\boxed{}",
        "I don't know.",
        "",
        f"Answer: the value is {answer}",
        f"{answer}\n{steps}",
        "x" * 5000 + f" \\boxed{{{answer}}}",  # huge
        f"{steps}\n" * 40 + f"\\boxed{{{answer}}}",
        f"\\boxed{{{answer}}}" + " filler" * 500,
        "\\boxed{é中😀\x00}",
        "}}{{\\\\boxed{{" + answer,
        f"\\boxed{{\\boxed{{{answer}}}}}",
        f"<answer>{answer}</answer>",
        f"\\text{{{answer}}}",
    ]


def _peer(reference: str, text: str) -> float:
    from math_verify import parse, verify

    return 1.0 if verify(parse(f"\\boxed{{{reference}}}"), parse(text)) else 0.0


@pytest.mark.parametrize("lenient, at_least", [(False, 0.99), (True, 0.99)])
def test_agreement_with_math_verify(lenient, at_least):
    """Generated cases scored by gapless and by math-verify's own `verify(parse(gold), parse(text))`
    (measured: 100% with the defaults; the named additions, where math-verify reads nothing, differ
    on the cases listed in docs/environments.md)."""
    rng = random.Random(21)
    cases, disagreements = 0, []
    for i, reference in enumerate(REFERENCES):
        for text in math_completions(reference, REFERENCES[(i + 7) % len(REFERENCES)], rng):
            ours, _ = grade(reference, text, lenient=lenient)
            cases += 1
            if ours != _peer(reference, text):
                disagreements.append((reference, text[:60], ours))
    assert cases >= 500
    assert 1 - len(disagreements) / cases >= at_least, disagreements


def _grade_off_main_thread(out) -> None:
    results = []
    thread = threading.Thread(target=lambda: results.append(grade("11", "\\boxed{11}")))
    thread.start()
    thread.join(timeout=120)
    out.put(results)


def test_grading_off_the_main_thread_of_a_daemonic_process():
    """A pipeline actor is a daemonic process, which multiprocessing forbids to have children:
    the helper is started with subprocess, so the environment process grades too."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    process = ctx.Process(target=_grade_off_main_thread, args=(out,), daemon=True)
    process.start()
    try:
        assert out.get(timeout=120) == [(1.0, "ok")]
    finally:
        process.join(timeout=30)


STAND_IN_HELPER = """
import json, os, signal, sys
marker = sys.argv[1]
for line in sys.stdin:
    completion = json.loads(line)[1]
    if "CRASH" in completion or ("ONCE" in completion and not os.path.exists(marker)):
        if "ONCE" in completion:
            open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # as a segfault deep in a parser would end it
    print(json.dumps([1.0, "ok"]), flush=True)
"""


def test_a_helper_that_dies_on_an_answer_is_retried_once_and_then_blames_the_answer(monkeypatch, tmp_path):
    """Only the answer's text reaches the helper: a death that recurs in a fresh helper is the
    answer's (`grader_crash`, reward 0, never infra_error); one that does not is an outage, and
    the fresh helper's verdict stands. A real process stands in for math-verify, which has no
    answer known to crash it."""
    import subprocess
    import sys

    from gapless.envs.math import answer as math_answer

    started = []

    def start_stand_in():
        started.append(subprocess.Popen([sys.executable, "-c", STAND_IN_HELPER, str(tmp_path / "died")],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))  # fmt: skip
        return started[-1]

    monkeypatch.setattr(math_answer, "_start_helper", start_stand_in)
    monkeypatch.setattr(math_answer, "_helper", None)
    results = {}

    def worker():
        results["crash"] = grade("1", "CRASH")
        results["once"] = grade("1", "ONCE")
        results["fine"] = grade("1", "1")

    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(timeout=60)
    finally:
        for process in started:
            process.kill()
            process.wait()
    assert results == {"crash": (0.0, "grader_crash"), "once": (1.0, "ok"), "fine": (1.0, "ok")}
    assert len(started) == 4  # crash: two helpers died; once: one died, the next answered, and "fine"
