"""Code problems from data files: schema, malformed records, and sandboxed scoring by table."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gapless.envs.code.dataset import CodeTask, load_code_dataset, parse_code_record
from gapless.envs.code.environment import CodeEnvironment
from gapless.envs.records import DatasetError
from gapless.sandbox import BwrapSandbox, SandboxLimits

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
LIMITS = SandboxLimits(timeout_s=3.0)
ASSERTS = {
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "split": "train",
    "tests": ["assert candidate(1, 2) == 3", "assert candidate(-1, 1) == 0", "assert add(2, 2) == 4"],
}
IO = {
    "prompt": "def rev(s):\n",
    "entry_point": "rev",
    "split": "eval",
    "inputs": [["ab"], ["xyz"]],
    "outputs": ["ba", "zyx"],
}
CHECK = {
    "prompt": "def sq(x):\n",
    "entry_point": "sq",
    "split": "train",
    "tests": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n",
}


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_jsonl_and_parquet_load_the_same_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    splits = load_code_dataset(write_jsonl(tmp_path / "d.jsonl", [ASSERTS, IO, CHECK]))
    assert [t.entry_point for t in splits["train"]] == ["add", "sq"] and [t.entry_point for t in splits["eval"]] == [
        "rev"
    ]
    rows = [ASSERTS, CHECK]  # Parquet wants one schema: the `tests` column holds lists, `check` gets one element
    table = pa.Table.from_pylist([ASSERTS, {**CHECK, "tests": [CHECK["tests"]]}])
    pq.write_table(table, tmp_path / "d.parquet")
    from_parquet = load_code_dataset(tmp_path / "d.parquet")["train"]
    assert [t.test_inputs for t in from_parquet] == [t.test_inputs for t in splits["train"]]
    assert len(rows) == len(from_parquet)


def test_malformed_records_are_named_by_file_and_line_and_nothing_is_dropped(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            ASSERTS,
            "{not json",
            {"entry_point": "f", "tests": ["assert True"]},  # no prompt
            {"prompt": "def f():\n", "entry_point": "f", "tests": ["assert (("]},  # a test that does not compile
            {"prompt": "def f():\n", "entry_point": "f", "inputs": [[1]], "outputs": []},
            [1, 2],
            IO,
        ],
    )
    with pytest.raises(DatasetError) as err:
        load_code_dataset(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:2: not JSON")
    assert "(5 bad record(s) in bad.jsonl; nothing was loaded)" in message
    for fragment in [
        "bad.jsonl:2: not JSON",
        "bad.jsonl:3: missing field 'prompt'; add it",
        "bad.jsonl:4: test 0 does not compile",
        "bad.jsonl:5: fields 'inputs' and 'outputs'",
        "bad.jsonl:6: expected a JSON object",
    ]:
        assert fragment in message
    with pytest.raises(DatasetError, match="no records"):
        load_code_dataset(write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(DatasetError, match="missing.jsonl: no such data file; check task.path"):
        load_code_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="broken.parquet: not a readable Parquet file"):
        load_code_dataset(tmp_path / "broken.parquet")


@pytest.mark.parametrize(
    "records, expected",
    [
        (
            [ASSERTS, IO, {**CHECK, "uid": "p1"}, {**ASSERTS, "uid": "p1"}],
            r"d.jsonl:4: uid 'p1' is already used by .*d.jsonl:3; give each record its own uid",
        ),
        ([ASSERTS, IO, ASSERTS], r"d.jsonl:3: the same record as .*d.jsonl:1; remove one of them"),
        (
            [ASSERTS, {**ASSERTS, "tests": ["assert candidate(0, 0) == 0"]}],
            r"d.jsonl:2: gets the same default uid '[0-9a-f]{16}' as .*d.jsonl:1 .*add a distinct 'uid' to each",
        ),
        (
            [{"prompt": "def f():\n", "entry_point": "f"}],
            r"d.jsonl:1: has no tests: give 'tests' \(test sources that call `candidate`\) or 'inputs' and 'outputs'",
        ),
        (
            [{"prompt": "def f():\n", "entry_point": "f", "inputs": [[1]]}],
            r"d.jsonl:1: has 'inputs' but no 'outputs'; give both",
        ),
        ([{**ASSERTS, "inputs": [[1]], "outputs": [1]}], r"d.jsonl:1: has both 'tests' and 'inputs'/'outputs'"),
    ],
)
def test_duplicates_and_missing_tests_are_refused_naming_the_lines(tmp_path, records, expected):
    with pytest.raises(DatasetError, match=expected) as err:
        load_code_dataset(write_jsonl(tmp_path / "d.jsonl", records))
    assert "\n" not in str(err.value)


def test_a_non_utf8_file_is_reported_by_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ASSERTS).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(
        DatasetError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\); save the file as UTF-8"
    ):
        load_code_dataset(path)
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ASSERTS).encode() + b"\n")  # a byte-order mark is not an error
    assert [t.entry_point for t in load_code_dataset(path)["train"]] == ["add"]


def test_gapless_train_on_a_bad_file_prints_one_line_and_exits_2(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ASSERTS, {**ASSERTS, "split": "eval"}])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "train",
            "--task.name",
            "code_dataset",
            "--task.path",
            str(path),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"gapless: error: {path}:2: gets the same default uid "
        + done.stderr.split("default uid ")[1].split(" as ")[0]
        + f" as {path}:1 "
        "(no 'uid' field, so the uid is derived from the prompt); add a distinct 'uid' to each "
        "(1 bad record(s) in bad.jsonl; nothing was loaded)"
    ]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("data") / "d.jsonl", [ASSERTS, IO, CHECK])
    environment = CodeEnvironment(BwrapSandbox(LIMITS), LIMITS, concurrency=4, splits=load_code_dataset(path))
    yield environment
    environment.close()


def _task(env, entry_point):
    return next(t for split in ("train", "eval") for t in env.tasks(split) if t.entry_point == entry_point)


@needs_bwrap
@pytest.mark.parametrize(
    "entry, completion, status, reward",
    [
        ("add", "    return a + b", "ok", 1.0),
        ("add", "    return abs(a) + b", "wrong_answer", 2 / 3),
        ("add", "    return a +* b", "compile_error", 0.0),
        ("add", "    raise SystemExit(0)", "wrong_answer", 0.0),  # exiting inside a test fails that test
        ("add", "    __import__('os')._exit(0)", "harness_incomplete", 0.0),  # kills the harness: nothing reported
        ("add", "    while True: pass", "timeout", 0.0),
        (
            "add",
            "    return a + b\ndef check(c):\n    pass",
            "ok",
            1.0,
        ),  # a candidate's own `check` is never run as a test
        ("add", "    return a + b\nraise ValueError", "harness_incomplete", 0.0),  # fails at import
        ("add", "x" * 10_000, "compile_error", 0.0),
        ("add", "    return '\u00e9\u4e2d\U0001f600'", "wrong_answer", 0.0),
        ("sq", "    return x * x", "ok", 1.0),
        ("sq", "    return x * abs(x)", "wrong_answer", 0.0),  # one check() of two asserts: all or nothing
        ("rev", "    return s[::-1]", "ok", 1.0),
        ("rev", "    return s", "wrong_answer", 0.0),
        ("rev", '    print(\'{"i": 0, "out": "ba"}\')\n    return 1', "wrong_answer", 0.0),  # fake stdout report
    ],
)
def test_statuses_and_rewards(env, entry, completion, status, reward):
    got_reward, got_status, _ = env.score_text(_task(env, entry), completion)
    assert (got_status, got_reward) == (status, pytest.approx(reward))


@needs_bwrap
def test_all_pass_reward_gives_no_partial_credit(env):
    strict = CodeEnvironment(env.sandbox, LIMITS, concurrency=1, reward="all_pass")
    assert strict.score_text(_task(env, "add"), "    return abs(a) + b")[:2] == (0.0, "wrong_answer")
    assert strict.score_text(_task(env, "add"), "    return a + b")[:2] == (1.0, "ok")


@needs_bwrap
def test_a_grade_never_crosses_problems_that_share_a_uid(env):
    """Two problems with the same uid and different tests: the same text is graded against each one's own tests."""
    add = parse_code_record({**ASSERTS, "uid": "same"})
    sub = parse_code_record({**ASSERTS, "uid": "same", "tests": ["assert candidate(3, 1) == 2"]})
    assert isinstance(add, CodeTask) and add.uid == sub.uid and add.prompt == sub.prompt
    text = "    return a + b"
    (on_add, on_sub) = env.score_groups([add, sub], [[_completion(text)], [_completion(text)]])
    assert [(r.reward, r.status) for r in on_add] == [(1.0, "ok")]
    assert [(r.reward, r.status) for r in on_sub] == [(0.0, "wrong_answer")]


def _completion(text):
    from gapless.types import Completion

    return Completion([], [], [], [], "stop", text)
