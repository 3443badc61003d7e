"""The built-in base "chat_arithmetic" (service/arithmetic_base.py): its demonstrations are math_rl's
prompts token for token as the cookbook's qwen3_instruct renderer writes them, its replies fit
math_rl's default max_tokens, it is built once and loaded from the cache after, and the config
names it as a base model's `builtin`."""

from __future__ import annotations

import random
import re

import pytest
import torch

from gapless.config import ConfigError, load_config
from gapless.models import IM_END, train_tokenizer
from gapless.service import arithmetic_base
from gapless.service.arithmetic_base import BOXED, FEWSHOT, SUFFIXES, chat_arithmetic_model, conversation, question
from gapless.service.models import BaseModels


def _tokenizer():
    rng = random.Random(0)
    return train_tokenizer([p + r for p, r in (conversation(rng) for _ in range(500))], 384, (BOXED,))


def test_prompts_are_math_rl_prompts_as_the_cookbook_renders_them():
    pytest.importorskip("tinker_cookbook")
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.math_env import MathEnv

    assert MathEnv.standard_fewshot_prefix() == FEWSHOT
    assert SUFFIXES == (MathEnv.question_suffix(),)  # what MathEnv, math_rl's gsm8k env, asks with
    tok = _tokenizer()
    renderer = renderers.get_renderer("qwen3_instruct", tokenizer=tok)
    rng = random.Random(1)
    seen_prefix = seen_bare = False
    for _ in range(100):
        prompt, reply = conversation(rng)
        messages = [
            {"role": role, "content": text}
            for role, text in re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", prompt, re.S)
        ]
        seen_prefix |= messages[:2] == FEWSHOT
        seen_bare |= len(messages) == 1
        expected = renderer.build_generation_prompt(messages).to_ints()
        assert tok.encode(prompt, add_special_tokens=False) == expected
        assert renderer.get_stop_sequences() == [tok.convert_tokens_to_ids(IM_END)]
        assert re.fullmatch(r"\\boxed\{-?\d+\}", reply), reply
    assert seen_prefix and seen_bare


def test_a_two_digit_reply_fits_math_rl_default_max_tokens():
    tok = _tokenizer()
    assert len(tok.encode(f"{BOXED}17}}{IM_END}", add_special_tokens=False)) == 5  # max_tokens=5, the recipe's default


def test_the_teacher_is_right_most_of_the_time_and_off_by_one_otherwise():
    rng = random.Random(2)
    right = 0
    for _ in range(2000):
        prompt, reply = conversation(rng)
        expression = re.search(r"([-+*\d]+)[.?] [^\n]*<\|im_end\|>\n<\|im_start\|>assistant\n$", prompt).group(1)
        value = int(reply[len(BOXED) : -1])
        assert abs(value - eval(expression)) <= 1, (prompt, reply)
        right += value == eval(expression)
    assert 0.58 < right / 2000 < 0.72  # 1 - TEACHER_ERROR_FRAC
    assert len({question(random.Random(s))[0] for s in range(400)}) > 150  # forms x digits


def test_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(
        arithmetic_base, "WARMSTART", arithmetic_base.WARMSTART.model_copy(update={"steps": 2, "batch_size": 4})
    )
    small = {"model.hidden_size": "32", "model.num_layers": "1", "model.intermediate_size": "64"}
    cfg = load_config(None, {"warmstart.cache_dir": f'"{tmp_path}"', **small})
    logs: list[str] = []
    first = chat_arithmetic_model(cfg, logs.append)
    assert any("warm start" in line for line in logs)
    logs.clear()
    again = chat_arithmetic_model(cfg, logs.append)
    assert logs and "cached" in logs[0]
    assert (
        len(again.tokenizer) == len(first.tokenizer) == again.tokenizer.convert_tokens_to_ids(BOXED) + 1
    )  # added last
    for (name, a), b in zip(first.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), name
    # a base model entry names it
    bases = BaseModels(
        {"m": {"builtin": "chat_arithmetic"}},
        builtin=lambda: pytest.fail("the tiny model is not asked for"),
        builtins={"chat_arithmetic": lambda: again},
        tokenizer_root=tmp_path / "tok",
    )
    assert bases.get("m").policy is again and bases.get("m").renderer is None


def test_a_path_and_a_builtin_together_are_a_config_error():
    with pytest.raises(ConfigError, match=re.escape("service.base_models.'m'") + ".*builtin"):
        load_config(None, {"service.base_models": '{"m" = {path = "x", builtin = "chat_arithmetic"}}'})


def test_builtin_models_get_qwen_think_tokens_for_the_qwen3_5_renderers(tmp_path):
    pytest.importorskip("tinker_cookbook")
    from serve_model import tiny_policy

    from gapless.service.hub_cache import check_renderer

    policy = tiny_policy()
    assert check_renderer("qwen3_5_disable_thinking", policy.tokenizer) is not None  # `</think>` is not one token
    base = BaseModels({"Qwen/Qwen3.5-4B": {}}, builtin=lambda: policy, tokenizer_root=tmp_path).get("Qwen/Qwen3.5-4B")
    assert base.renderer == "qwen3_5"  # the name's renderer, checked at start: it now works
    for renderer in ("qwen3_5", "qwen3_5_disable_thinking", "qwen3_instruct"):
        assert check_renderer(renderer, policy.tokenizer) is None, renderer
    think = policy.tokenizer.convert_tokens_to_ids("</think>")
    assert policy.tokenizer.decode([think]) == "</think>" and base.vocab_size == len(policy.tokenizer)
