"""`task.name` builds the environment it names; task config mistakes are one-line errors."""

import json
import shutil

import pytest

from gapless.config import ConfigError, load_config
from gapless.envs.base import Environment, Teacher
from gapless.envs.registry import make_environment

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture
def code_file(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(
        json.dumps(
            {"prompt": "def f(x):\n", "entry_point": "f", "tests": ["assert candidate(1) == 2"], "split": "train"}
        )
        + "\n"
    )
    return path


@pytest.mark.parametrize(
    "name, extra, teacher",
    [
        ("procedural_code", {}, True),
        ("humaneval", {}, False),
        ("code_dataset", {"task.path": "CODE"}, False),
        ("math", {}, True),
        ("reasoning_gym", {"task.reasoning_gym_dataset": '"chain_sum"'}, False),
        ("tool_use", {"tools.num_train_prompts": "40", "tools.num_eval_prompts": "10"}, True),
        ("repo", {"repo.num_train_prompts": "40", "repo.num_eval_prompts": "10"}, True),
        ("judge", {"judge.base_url": '"http://127.0.0.1:9/v1"'}, True),
    ],
)
def test_each_name_builds_its_environment(name, extra, teacher, code_file):
    if name in ("procedural_code", "humaneval", "code_dataset", "tool_use", "repo") and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    overrides = {
        "task.name": json.dumps(name),
        "task.num_train_prompts": "40",
        "task.num_eval_prompts": "10",
        **{k: json.dumps(str(code_file)) if v == "CODE" else v for k, v in extra.items()},
    }
    env = make_environment(load_config(None, overrides))
    try:
        assert isinstance(env, Environment) and isinstance(env, Teacher) == teacher
        assert env.name.startswith(name)
        assert len(env.tasks("train")) + len(env.tasks("eval")) > 0
    finally:
        env.close()


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"task.name": '"code_dataset"'}, "task.path: task.name = 'code_dataset' needs"),
        (
            {"task.name": '"code_dataset"', "task.path": '"/no/such.jsonl"'},
            "task.path: file '/no/such.jsonl' does not exist",
        ),
        ({"task.path": '"x.jsonl"'}, "task.path is read only by"),
        ({"task.name": '"chess"'}, "task.name"),
    ],
)
def test_task_config_errors(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)
