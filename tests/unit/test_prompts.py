"""Prompt formats on a tokenizer that has a chat template (ChatML with a BOS, as Qwen/Llama-3
style templates write it): the exact prompt tokens, one BOS, the end-of-turn stop in the engine,
an environment reply as the next turn, and the format surviving save/load."""

import pytest
import torch
from tokenizers import processors

from gapless.config import ConfigError, ModelConfig
from gapless.generate.engine import TorchEngine
from gapless.models import build_tiny, load_local
from gapless.prompts import PromptEncoder
from gapless.types import SamplingParams

BOS, START, END = "<|bos|>", "<|im_start|>", "<|im_end|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}" + START + "{{ m['role'] }}\n{{ m['content'] }}" + END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + START + "assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_policy(problems):
    """The tiny model's tokenizer made an instruct one: turn tokens, a chat template, and a
    post-processor that adds BOS on plain encode (the doubled-BOS trap)."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)
    policy = build_tiny(cfg, [p.prompt + p.solution for p in problems], seed=0)
    tok = policy.tokenizer
    tok.add_special_tokens({"bos_token": BOS, "additional_special_tokens": [START, END]})
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.convert_tokens_to_ids(BOS))]
    )
    tok.chat_template = TEMPLATE
    policy.model.resize_token_embeddings(len(tok))
    policy.encode = PromptEncoder(tok, "auto")
    return policy


def _ids(tok, *tokens_or_text):
    out = []
    for piece in tokens_or_text:
        out += (
            [tok.convert_tokens_to_ids(piece)]
            if piece in (BOS, START, END)
            else tok.encode(piece, add_special_tokens=False)
        )
    return out


def test_auto_is_chat_and_prompt_tokens_are_exact(chat_policy):
    tok = chat_policy.tokenizer
    assert chat_policy.encode.format == "chat"
    assert tok.encode("x")[0] == tok.convert_tokens_to_ids(BOS)  # plain encode adds a BOS ...
    got = chat_policy.encode("add 2 and 3")
    want = _ids(tok, BOS, START, "user\nadd 2 and 3", END, "\n", START, "assistant\n")
    assert got == want  # ... the chat prompt has exactly the template's one
    assert got.count(tok.convert_tokens_to_ids(BOS)) == 1
    with_system = PromptEncoder(tok, "chat", system_prompt="Be brief.")("hi")
    assert with_system == _ids(
        tok, BOS, START, "system\nBe brief.", END, "\n", START, "user\nhi", END, "\n", START, "assistant\n"
    )
    assert PromptEncoder(tok, "raw")("hi") == tok.encode("hi", add_special_tokens=False)


def test_a_kept_prompt_is_encoded_once_and_equals_a_fresh_encoding(chat_policy):
    tok = chat_policy.tokenizer
    encoder = PromptEncoder(tok, "chat")
    calls = []
    encoder.text = lambda text: calls.append(text) or tok.encode(text, add_special_tokens=False)
    fresh = PromptEncoder(tok, "chat")("add 2 and 3")
    encoder.keep(["add 2 and 3"])
    first, second = encoder("add 2 and 3"), encoder("add 2 and 3")
    assert first == second == fresh and len(calls) == 1
    first.append(0)  # a caller's list is its own: the kept ids stay as they were
    assert encoder("add 2 and 3") == fresh
    encoder("a judge's one-off prompt"), encoder("a judge's one-off prompt")
    assert len(calls) == 3  # a prompt not kept is encoded each time, and not stored
    assert "a judge's one-off prompt" not in encoder._kept


def test_end_of_turn_is_the_stop_and_an_env_reply_is_the_next_turn(chat_policy):
    tok = chat_policy.tokenizer
    end = tok.convert_tokens_to_ids(END)
    assert chat_policy.stop_ids == (end,)
    # after the model's turn "A<|im_end|>", the reply opens a user turn and the assistant's next
    assert chat_policy.encode.turn("out: 5") == _ids(tok, "\n", START, "user\nout: 5", END, "\n", START, "assistant\n")


def test_engine_stops_on_the_templates_end_of_turn(chat_policy):
    """A model whose LM head makes <|im_end|> the greedy choice after a few tokens: with the chat
    format's stop ids the completion ends there ('stop'); without them it runs to the length cap."""
    model = type(chat_policy.model)(chat_policy.model.config).eval()
    model.load_state_dict(chat_policy.model.state_dict())
    model.config.tie_word_embeddings = False
    end = chat_policy.tokenizer.convert_tokens_to_ids(END)
    prompt = chat_policy.encode("add 2 and 3")
    free = TorchEngine(model, chat_policy.eos_id, kernels="torch").generate(
        [prompt], SamplingParams(greedy=True, max_new_tokens=6)
    )[0]
    assert end not in free.token_ids
    with torch.no_grad():  # a fresh untied head: <|im_end|>'s row copies the third token's, scaled up
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.clone())
        model.lm_head.weight[end] = model.lm_head.weight[free.token_ids[2]] * 1.5
    plain = TorchEngine(model, chat_policy.eos_id, kernels="torch").generate(
        [prompt], SamplingParams(greedy=True, max_new_tokens=6)
    )[0]
    stopped = TorchEngine(model, chat_policy.eos_id, kernels="torch", stop_ids=chat_policy.stop_ids).generate(
        [prompt], SamplingParams(greedy=True, max_new_tokens=6)
    )[0]
    k = plain.token_ids.index(end)  # the head change makes <|im_end|> greedy somewhere
    assert stopped.token_ids == plain.token_ids[: k + 1] and stopped.finish_reason == "stop"
    assert plain.finish_reason == "length" and len(plain.token_ids) == 6


def test_format_survives_save_and_load_and_chat_needs_a_template(chat_policy, tiny_policy, tmp_path):
    chat_policy.encode = PromptEncoder(chat_policy.tokenizer, "chat", system_prompt="Be brief.")
    chat_policy.save(tmp_path / "chat")
    loaded = load_local(tmp_path / "chat")
    assert (loaded.encode.format, loaded.encode.system_prompt) == ("chat", "Be brief.")
    assert loaded.encode("hi") == chat_policy.encode("hi")
    assert load_local(tmp_path / "chat", "raw").encode.format == "raw"
    tiny_policy.save(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()  # a checkpoint without a chat template
    with pytest.raises(ConfigError, match=r"model.prompt_format = 'chat' but the tokenizer in .* has no chat template"):
        load_local(tmp_path / "plain", "chat")
