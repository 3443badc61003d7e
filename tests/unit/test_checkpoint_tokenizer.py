"""Every checkpoint gapless writes reads the same outside gapless: plain `AutoTokenizer` /
`AutoModelForCausalLM.from_pretrained` (as lm-eval, vLLM and every Hugging Face user load it) give
the tokenizer gapless trains with, token for token over tricky texts, and the same model.
transformers rebuilds a qwen2 checkpoint's tokenizer as its Qwen2 class whatever tokenizer.json
says, so this is what holds the embedded tokenizer's pre-tokenizer to that class's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gapless.config import ModelConfig
from gapless.lora import LoraSpec, attach_lora
from gapless.models import EOS, IM_END, IM_START, PAD, build_tiny, load_local, save_tokenizer
from gapless.trainer.checkpoint import save_checkpoint

TRICKY = [
    "def f(x):\n    return x + 1\n",  # indentation: a run of spaces after a newline
    "a   b\t\tc \t d",  # runs of spaces and tabs
    "\n\n\nx\r\ny  \n  ",  # newlines, CRLF, trailing spaces
    "  lead and trail  ",
    "héllo ✓ 中文 😀 e\u0301 ﬁ",  # unicode, emoji, a combining accent (NFC), a ligature
    "12345 + 6789 = 19134",  # digits stay single
    "it's we'll THEY'RE",  # contractions
    f"{EOS}x{PAD}{IM_START}user\nhi{IM_END}\n<|endoftext|>",  # special tokens, and one that is not
    "",
]
TEXTS = [f"def add_{i}(a, b):\n    return a + b * {i}  # {'x' * (i % 5)}\n\tprint('ok')" for i in range(60)]


def _same_tokenizer(ours, path) -> None:
    theirs = AutoTokenizer.from_pretrained(path)
    assert len(theirs) == len(ours) and theirs.eos_token == ours.eos_token == EOS and theirs.pad_token == PAD
    for text in TRICKY:
        for special in (False, True):
            assert theirs.encode(text, add_special_tokens=special) == ours.encode(text, add_special_tokens=special), (
                text
            )
        ids = ours.encode(text, add_special_tokens=False)
        assert theirs.decode(ids) == ours.decode(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi  there"}]
    rendered = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rendered == ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert theirs.convert_tokens_to_ids([IM_START, IM_END]) == ours.convert_tokens_to_ids([IM_START, IM_END])
    assert rendered[:1] == [theirs.convert_tokens_to_ids(IM_START)]  # the turn tokens are special, one id each


def _cfg(architecture: str) -> ModelConfig:
    return ModelConfig(
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        vocab_size=300,
        architecture=architecture,
    )


@pytest.mark.parametrize("architecture", ["qwen2", "llama", "phi3", "gemma3"])
def test_the_embedded_checkpoint_loads_identically(architecture, tmp_path):
    policy = build_tiny(_cfg(architecture), TEXTS, seed=0)
    policy.save(tmp_path)
    _same_tokenizer(policy.tokenizer, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([policy.tokenizer.encode(TRICKY[0])])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=1e-5)
    assert len(policy.tokenizer) <= model.config.vocab_size  # every token id has an embedding row


def test_the_embedded_tokenizer_is_compact_on_code():
    """The two-line function of the report: a handful of tokens, as gapless and AutoTokenizer both see it."""
    tok = build_tiny(_cfg("qwen2"), TEXTS, seed=0).tokenizer
    assert len(tok.encode("def add_3(a, b):\n    return a + b * 3", add_special_tokens=False)) <= 20


def test_the_embedded_format_stays_raw_and_chat_uses_chatml(tmp_path):
    policy = build_tiny(_cfg("qwen2"), TEXTS, seed=0)
    assert policy.encode.format == "raw"  # 'auto' on the embedded model: its tasks are plain text
    chat = build_tiny(_cfg("qwen2").model_copy(update={"prompt_format": "chat"}), TEXTS, seed=0)
    tok = chat.tokenizer
    assert chat.stop_ids == (tok.convert_tokens_to_ids(IM_END),)
    want = (
        [tok.convert_tokens_to_ids(IM_START)]
        + tok.encode("user\nadd 2", add_special_tokens=False)
        + [tok.convert_tokens_to_ids(IM_END)]
        + tok.encode("\n", add_special_tokens=False)
        + [tok.convert_tokens_to_ids(IM_START)]
        + tok.encode("assistant\n", add_special_tokens=False)
    )
    assert chat.encode("add 2") == want
    chat.save(tmp_path)
    assert load_local(tmp_path).encode.format == "chat"


def test_lora_and_tokenizer_only_saves_load_identically(tmp_path):
    policy = build_tiny(_cfg("qwen2"), TEXTS, seed=0)
    adapted = attach_lora(policy.model, LoraSpec(rank=2, seed=0))
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-3)
    step = save_checkpoint(tmp_path, policy, optimizer, 1, {}, adapted=adapted)
    _same_tokenizer(policy.tokenizer, step)  # the adapter directory's tokenizer
    _same_tokenizer(policy.tokenizer, tmp_path / "checkpoints" / "base")
    save_tokenizer(policy.tokenizer, tmp_path / "tokenizer_only")  # what the Tinker service hands its clients
    _same_tokenizer(policy.tokenizer, tmp_path / "tokenizer_only")
