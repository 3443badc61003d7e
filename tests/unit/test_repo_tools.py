"""The repo task's command parser (untrusted text never raises) and its turn format: with a chat
template, prompt + model turns + EOS + replies is exactly the rendered conversation."""

from __future__ import annotations

import pytest

from gapless.config import ModelConfig
from gapless.envs.repo.tasks import generate_repo_tasks
from gapless.envs.repo.tools import PLAIN, chat_format, parse_command, shown, solution_text
from gapless.models import build_tiny

CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<cmd>",
        "<cmd></cmd>",
        "<cmd>patch</cmd>",
        "<cmd>write /x\n</cmd>",
        "<cmd>run </cmd>",
        "<cmd>cat a/../../b</cmd>",
        "<cmd>cat a\x00b</cmd>",
        "\x00" * 9,
        "<cmd>patch a.py\nold only</cmd>",
        "<cmd>patch a.py\n---\nnew</cmd>",
    ],
)
def test_malformed_commands_never_raise(text):
    assert parse_command(text).kind in ("none", "invalid")


def test_commands_parse():
    assert parse_command("x <cmd>patch geo.py\n    return a - b\n---\n    return a + b</cmd> y") == parse_command(
        "<cmd>patch geo.py\n    return a - b\n---\n    return a + b</cmd>"
    )
    patch = parse_command("<cmd>patch geo.py\n    return a - b\n---\n    return a + b</cmd>")
    assert (patch.kind, patch.path, patch.old, patch.new) == ("patch", "geo.py", "    return a - b", "    return a + b")
    assert parse_command("<cmd>run echo 1\necho 2</cmd>").text == "echo 1\necho 2"
    assert parse_command("<cmd>write a/b.py\nx = 1\n</cmd>").text == "x = 1\n"


def test_shown_keeps_head_and_tail_within_the_byte_cap():
    text = "a" * 100 + "é" * 100 + "z" * 100
    cut = shown(text, 64)
    assert len(cut.encode()) <= 64 and cut.startswith("a") and cut.endswith("z") and "..." in cut
    assert shown("short", 64) == "short"


def test_a_chat_template_frames_turns_token_exactly():
    tasks = generate_repo_tasks(0, "train", 4)
    policy = build_tiny(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300),
        [t.prompt + solution_text(t) for t in tasks],
        seed=0,
    )
    tokenizer = policy.tokenizer
    tokenizer.chat_template = None
    assert chat_format(tokenizer) == PLAIN  # no template: plain turns
    tokenizer.chat_template = CHATML
    fmt = chat_format(tokenizer)
    eos = tokenizer.eos_token
    turns, observations = ["<cmd>cat geo.py</cmd>", "<cmd>done</cmd>"], ["def f(a, b):\n    return a + b\n"]
    episode = fmt.prompt(tasks[0].prompt) + turns[0] + eos + fmt.reply(observations[0]) + turns[1] + eos
    messages = [
        {"role": "user", "content": tasks[0].prompt},
        {"role": "assistant", "content": turns[0]},
        {"role": "user", "content": f"<out>{observations[0]}</out>\n"},
        {"role": "assistant", "content": turns[1]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert episode == rendered.rstrip("\n")
