"""The policy: a Hugging Face causal LM and its tokenizer, built tiny locally or loaded from disk.

`build_tiny` trains a byte-level BPE tokenizer (digits kept as single tokens, so arithmetic stays
regular; ChatML turn tokens and template; a task's markup tags as whole tokens) on the task's own text and creates a randomly
initialised model of one of the `TINY_ARCHITECTURES` from its transformers config. The tokenizer
normalises and pre-tokenises exactly as transformers' Qwen2 tokenizer does, because plain
`AutoTokenizer.from_pretrained` rebuilds a qwen2 checkpoint's tokenizer as that class whatever
its tokenizer.json says: so every checkpoint gapless writes tokenizes the same outside gapless; `load_local` opens any local HF checkpoint directory
(or a LoRA run's adapter checkpoint, merged into the base beside it). Nothing is ever downloaded: a
missing directory is a `FileNotFoundError` that says what to give instead, and a checkpoint that
is not a causal LM (or lacks a tokenizer) a one-line `ConfigError`, before any warm start.
Both return a `Policy`: the model (fp32, eval mode) plus the token ids the loop needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from gapless.config import ConfigError, ModelConfig
from gapless.prompts import PromptEncoder

PAD, EOS = "<|pad|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML turn tokens of the embedded tokenizer
# transformers' Qwen2 pre-tokenizer split (GPT-4 style words, single digits, runs of spaces and newlines)
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' + (message['content'] or '') + '" + IM_END + "\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + IM_START + "assistant\\n' }}{%- endif %}"
)
POLICY_FILE = "gapless_policy.json"  # prompt format and precision, written by Policy.save beside the HF files
hf_logging.disable_progress_bar()  # checkpoint writes would otherwise draw bars into the live log


@dataclass
class Policy:
    """`encode(prompt)` applies the prompt format (prompts.py); `encode.text` / `encode.turn`
    encode other text and an episode's environment replies; `stop_ids` are the format's
    end-of-turn tokens (empty for 'raw'), which the generator stops on besides eos."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    eos_id: int
    pad_id: int
    encode: PromptEncoder = field(default=None)  # type: ignore[assignment]  # None: raw

    def __post_init__(self):
        if self.encode is None:
            self.encode = PromptEncoder(self.tokenizer, "raw")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.encode.stop_ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def save(self, path: Path) -> None:
        """The HF checkpoint plus the resolved prompt format and precision, which `load_local` restores."""
        self.model.save_pretrained(path)
        save_tokenizer(self.tokenizer, path)
        record = {
            "prompt_format": self.encode.format,
            "system_prompt": self.encode.system_prompt,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "fp32_lm_head": isinstance(self.model.get_output_embeddings(), FP32Head),
        }
        (Path(path) / POLICY_FILE).write_text(json.dumps(record) + "\n")


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """`save_pretrained`, plus what a plain `AutoTokenizer.from_pretrained` needs to rebuild the
    same tokenizer: an explicit `unk_token: null` when there is none (the Qwen2 class would
    otherwise add its default `<|endoftext|>` as a new token past the model's vocabulary)."""
    tokenizer.save_pretrained(path)
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if tokenizer.unk_token is None and config.get("unk_token") is None:
        config["unk_token"] = None
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


class FP32Head(torch.nn.Linear):
    """An LM head that computes in float32 whatever its weight's dtype (`model.fp32_lm_head`).
    Swapped in as the module's class, so parameters and state-dict names are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            x.float(), self.weight.float(), None if self.bias is None else self.bias.float()
        )


def apply_precision(model: torch.nn.Module, cfg: ModelConfig | None) -> torch.nn.Module:
    """Cast to `model.dtype` ('auto' is float32 here: this process trains on the CPU) and
    install the float32 head if asked."""
    if cfg is None:
        return model
    if cfg.dtype == "bfloat16":
        model.to(torch.bfloat16)
    if cfg.fp32_lm_head:
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or getattr(model.config, "final_logit_softcapping", None):
            raise ConfigError(
                f"model.fp32_lm_head: the {model.config.model_type} head is not a plain linear layer; set it to false"
            )
        head.__class__ = FP32Head
    return model


def train_tokenizer(texts: Iterable[str], vocab_size: int, markup: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Deterministic byte-level BPE with Qwen2's normaliser and pre-tokenizer (single digits are
    never merged), the special tokens PAD, EOS and the ChatML turn tokens (ids 0-3, inside
    `vocab_size`), and a ChatML chat template. `markup` (a task's tags, e.g. `<py>`) are added
    as ordinary, non-special tokens past `vocab_size`, each one token wherever it occurs, as a
    chat model's tool-call tags are: the Qwen2 split would cut `</py>` into `</`, `py`, `>`,
    whose `>` also ends `<py>`, and a tiny model then cannot tell opening a call from closing it.
    They decode as text (completions keep them)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in markup])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny(
    cfg: ModelConfig, texts: Iterable[str], seed: int, max_positions: int = 512, markup: Sequence[str] = ()
) -> Policy:
    tokenizer = train_tokenizer(texts, cfg.vocab_size, markup)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(cfg.architecture, **common), dtype=torch.float32)
    apply_precision(model, cfg).eval()
    try:  # 'auto' is 'raw' here: the embedded tasks are written as plain text, the template is there for 'chat'
        fmt = "raw" if cfg.prompt_format == "auto" else cfg.prompt_format
        encoder = PromptEncoder(tokenizer, fmt, cfg.system_prompt, source="the embedded tiny model's tokenizer")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return Policy(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, encoder)


TINY_ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral", "phi3", "olmo2", "gemma2", "gemma3")


def tiny_config(architecture: str, **common):
    """The transformers config of `architecture` with the shared sizes `common` and the family's
    own features switched on at a tiny scale: mistral and the gemmas get a sliding window of 16
    tokens (so short contexts already cross it), gemma3 alternates local and global layers."""
    import transformers

    head_dim = common["hidden_size"] // common["num_attention_heads"]
    extra: dict = {}
    if architecture == "qwen2":
        cls = transformers.Qwen2Config
    elif architecture == "llama":
        cls = transformers.LlamaConfig
    elif architecture == "qwen3":
        cls, extra = transformers.Qwen3Config, dict(head_dim=head_dim)
    elif architecture == "mistral":
        cls, extra = transformers.MistralConfig, dict(sliding_window=16, head_dim=head_dim)
    elif architecture == "phi3":
        cls = transformers.Phi3Config
    elif architecture == "olmo2":
        cls = transformers.Olmo2Config
    elif architecture == "gemma2":
        cls, extra = (
            transformers.Gemma2Config,
            dict(head_dim=head_dim, sliding_window=16, query_pre_attn_scalar=head_dim),
        )
    elif architecture == "gemma3":
        cls, extra = (
            transformers.Gemma3TextConfig,
            dict(head_dim=head_dim, sliding_window=16, query_pre_attn_scalar=head_dim, sliding_window_pattern=2),
        )
    else:
        raise ValueError(f"model.architecture: {architecture!r} is not one of {TINY_ARCHITECTURES}")
    return cls(**common, **extra)


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A plain `tokenizers` file is loaded as is: AutoTokenizer would rebuild it as the model
    family's tokenizer class (e.g. Qwen2's), silently replacing its pre-tokenizer."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") in _PLAIN_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


_PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_local(
    path: str | Path,
    prompt_format: str | None = None,
    system_prompt: str | None = None,
    precision: ModelConfig | None = None,
) -> Policy:
    """`prompt_format` None or 'auto': the format a gapless checkpoint was saved with, else chat
    when the tokenizer has a template; 'raw' / 'chat' force one. `precision` (the model section):
    dtype and fp32 head; None restores a gapless checkpoint's own, else float32."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
        return _load_adapter_checkpoint(path, prompt_format, system_prompt, precision)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "point model.path at a local directory saved with save_pretrained, or unset it for the embedded tiny model"
        )
    kind = json.loads((path / "config.json").read_text()).get("model_type", "?")
    try:
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (ValueError, KeyError, OSError, ImportError) as err:  # transformers' ways of saying "not this"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.path {path}: cannot load model type {kind!r} as a causal LM with its tokenizer "
            f"({first_line[:200]}); gapless trains decoder-only checkpoints (docs/engine.md lists the families)"
        ) from None
    saved = path / POLICY_FILE
    record = json.loads(saved.read_text()) if saved.is_file() else {}
    if precision is None and record:
        precision = ModelConfig(
            dtype="bfloat16" if record.get("dtype") == "bfloat16" else "float32",
            fp32_lm_head=record.get("fp32_lm_head", False),
        )
    apply_precision(model, precision).eval()
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError(f"tokenizer in {path} has no eos token; set eos_token in its tokenizer_config.json")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if prompt_format in (None, "auto") and record:
        prompt_format, system_prompt = record["prompt_format"], system_prompt or record["system_prompt"]
    try:
        encoder = PromptEncoder(tokenizer, prompt_format or "auto", system_prompt, source=f"the tokenizer in {path}")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return Policy(model, tokenizer, eos_id, pad_id, encoder)


def _load_adapter_checkpoint(path: Path, prompt_format, system_prompt, precision) -> Policy:
    """A LoRA run's `checkpoints/step_N` (a peft adapter): its run's `checkpoints/base` with the
    adapter merged in, so `gapless eval` and `gapless serve` take it as any checkpoint."""
    from peft import PeftModel

    base = path.parent / "base"
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is a LoRA adapter but {base} (the base model its run writes beside it) is missing; "
            "load the adapter onto its base with peft's PeftModel.from_pretrained"
        )
    policy = load_local(base, prompt_format, system_prompt, precision)
    policy.model = PeftModel.from_pretrained(policy.model, path).merge_and_unload().eval()
    return policy


def load_encoder(path: str | Path) -> PromptEncoder:
    """The prompt encoder of a checkpoint saved by `Policy.save`, without its model (a process
    that only encodes text: the pipeline's environment, for episode replies)."""
    path = Path(path)
    saved = path / POLICY_FILE
    record = json.loads(saved.read_text()) if saved.is_file() else {}
    return PromptEncoder(
        load_tokenizer(path),
        record.get("prompt_format", "auto"),
        record.get("system_prompt"),
        source=f"the tokenizer in {path}",
    )
