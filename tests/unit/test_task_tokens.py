"""The code task's prompt ends where the embedded tokenizer's pre-tokenizer ends a piece, so the
prompt and a completion encoded apart (as the generator and the warm start encode them) are the
tokens of the whole function: the model never continues from a bare space."""

import pytest

from gapless.config import ModelConfig
from gapless.envs.code.problems import generate_problems
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
