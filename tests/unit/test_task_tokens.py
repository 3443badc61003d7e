"""The code task's prompt ends where the embedded tokenizer's pre-tokenizer ends a piece, so the
prompt and a completion encoded apart (as the generator and the warm start encode them) are the
tokens of the whole function: the model never continues from a bare space. The tool task's tags
are one token each."""

import pytest

from gapless.config import ModelConfig
from gapless.envs.code.problems import generate_problems
from gapless.envs.tools.tasks import CALL_CLOSE, CALL_OPEN, MARKUP, generate_tool_tasks, tool_output_text
from gapless.models import train_tokenizer


@pytest.mark.parametrize("levels", [[1], [1, 2, 3]])
def test_prompt_and_completion_encode_as_the_whole_function(levels):
    problems = generate_problems(0, "train", 300, levels)
    tokenizer = train_tokenizer([p.prompt + p.solution for p in problems], ModelConfig().vocab_size)
    for p in problems:
        for completion in (p.solution, p.overfit_solution):
            apart = tokenizer.encode(p.prompt) + tokenizer.encode(completion)
            assert apart == tokenizer.encode(p.prompt + completion), (p.prompt, completion)
        assert not p.prompt[-1].isspace()


def test_tool_task_tags_are_one_token_each_and_decode_as_text():
    """Under the Qwen2 split `</py>` would be `</`, `py`, `>`, sharing its `>` with `<py>`: the
    tool task's tags are added whole, so a call opens and closes with tokens of its own."""
    tasks = generate_tool_tasks(0, "train", 16)
    tokenizer = train_tokenizer([t.prompt + t.solution for t in tasks], 300, MARKUP)
    ids = {tag: tokenizer.encode(tag, add_special_tokens=False) for tag in MARKUP}
    assert all(len(i) == 1 for i in ids.values()) and len({i[0] for i in ids.values()}) == len(MARKUP)
    call = f"{CALL_OPEN}{tasks[0].expression}{CALL_CLOSE}"
    encoded = tokenizer.encode(call, add_special_tokens=False)
    assert encoded[0] == ids[CALL_OPEN][0] and encoded[-1] == ids[CALL_CLOSE][0]
    assert tokenizer.decode(encoded, skip_special_tokens=True) == call  # completions keep them
    assert tokenizer.encode(tool_output_text("12"), add_special_tokens=False)[0] == ids[MARKUP[2]][0]
