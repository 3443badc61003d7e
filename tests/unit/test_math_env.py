"""Math environment: answer extraction and math-verify equivalence, by table, including hostile output."""

import threading

import pytest

from gapless.envs.math import MathEnvironment, load_math_dataset
from gapless.envs.math_answer import extract_answer, grade
from gapless.envs.math_problems import generate_math_problems, left_to_right
from gapless.envs.records import DatasetError
from gapless.types import Completion


@pytest.mark.parametrize("reference, completion, follows_prompt, reward, status", [
    ("11", "11", True, 1.0, "ok"),
    ("11", " 11.\nmore text", True, 1.0, "ok"),
    ("11", "14", True, 0.0, "wrong_answer"),
    ("11", "so the value is \\boxed{11}", False, 1.0, "ok"),
    ("11", "\\boxed{3} then \\boxed{11}", False, 1.0, "ok"),  # the last box counts
    ("11", "Answer: 11", False, 1.0, "ok"),
    ("11", "11", False, 0.0, "no_answer"),  # no box, no "Answer:", prompt does not ask for a bare answer
    ("11", "", True, 0.0, "no_answer"),
    ("11", "\\boxed{", False, 0.0, "no_answer"),  # unclosed box
    ("11", "\\boxed{11", False, 0.0, "no_answer"),
    ("11", "\\boxed{}", False, 0.0, "no_answer"),
    ("\\frac{1}{2}", "\\boxed{0.5}", False, 1.0, "ok"),
    ("0.5", "1/2", True, 1.0, "ok"),
    ("-3", "-3", True, 1.0, "ok"),
    ("-3", "3", True, 0.0, "wrong_answer"),
    ("11", "abc", True, 0.0, "wrong_answer"),  # reads as the product a*b*c: an answer, not 11
    ("11", "é中😀", True, 0.0, "parse_error"),
    ("11", "9" * 100, True, 0.0, "wrong_answer"),  # a huge number is just wrong
    ("11", "9" * 5000, True, 0.0, "parse_error"),  # past MAX_ANSWER_CHARS: not even parsed
    ("11", "10^10^10^10", True, 0.0, "wrong_answer"),  # kept symbolic: compared without evaluating
    ("11", "\\boxed{\\frac{1}{0}}", False, 0.0, "wrong_answer"),  # zoo is not 11
    ("11", "x" * 10_000, True, 0.0, "parse_error"),
    ("11", "\x00\x01\\\\}}{{", True, 0.0, "parse_error"),
])
def test_grade_table(reference, completion, follows_prompt, reward, status):
    assert grade(reference, completion, follows_prompt) == (reward, status)


def test_extract_answer_takes_balanced_braces():
    assert extract_answer("\\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("Answer: 7. Because") == "7. Because"
    assert extract_answer("answer : 7\n8") == "7"


def test_grading_off_the_main_thread_uses_the_helper_process():
    results = {}

    def worker():
        results["ok"] = grade("11", "11", True)
        results["wrong"] = grade("11", "\\boxed{12}")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=120)
    assert results == {"ok": (1.0, "ok"), "wrong": (0.0, "wrong_answer")}


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
    assert [(r.reward, r.status) for r in groups[0]] == [(1.0, "ok"), (0.0, "parse_error"), (1.0, "ok")]


def test_math_dataset_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "What is half of one? Put it in \\\\boxed{}.", "answer": "\\\\frac{1}{2}", "split": "eval"}\n'
                    '{"prompt": "2+2?", "answer": 4, "split": "train"}\n')
    splits = load_math_dataset(path)
    assert [t.answer for t in splits["eval"]] == ["\\frac{1}{2}"]
    path.write_text('{"prompt": "2+2?", "answer": 4}\n{"prompt": "x", "answer": null}\n{"answer": "3"}\n')
    with pytest.raises(DatasetError, match=r"m.jsonl:2: field 'answer'.*m.jsonl:3: missing field 'prompt'"):
        load_math_dataset(path)


def _completion(text):
    return Completion([], [], [], [], "stop", text)
