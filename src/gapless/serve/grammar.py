"""Grammars for constrained decoding, compiled by xgrammar against the served tokenizer.

    StructureSpec (json_object | json_schema | regex | choice | ebnf)
        ──Grammars.compile──> CompiledGrammar (cached per spec) ──.constraint()──> GrammarConstraint
                                                                  one per sample: the engine's TokenConstraint

xgrammar (the library vLLM uses by default) precomputes, per grammar, which vocabulary tokens each
parser state can take, so a decode step costs one bitmask fill per constrained row. The token
table is built once from the tokenizer's vocabulary (`TokenizerInfo.from_huggingface`: byte-level
BPE, SentencePiece and added tokens), sized to the model's logits (a padded embedding's extra rows
are never allowed); the stop tokens it allows at the end of a structure are the engine's (EOS and
e.g. a chat template's end-of-turn token).

Guaranteed: a sample constrained by a spec only takes tokens that keep its text a prefix of a
string in the grammar; it ends with finish reason 'stop' exactly when the structure is complete
(then only a stop token is allowed), else at `max_tokens` with 'length'; JSON output always parses
(a string with minLength / maxLength is matched as a pattern of unescaped JSON characters: xgrammar's
own length rule lets control characters through; a non-ASCII `enum` / `const` string is matched
as a pattern: xgrammar mis-encodes non-ASCII literals), and the bytes of a constrained reply are valid
UTF-8 (`Utf8Masks`: xgrammar's byte-level matching admits overlong and surrogate sequences, which
decode to U+FFFD and break lengths, patterns and enums). JSON is generated without
free whitespace (`any_whitespace=False`: a small or undertrained model cannot spend its tokens on
blank lines). A schema or regex xgrammar cannot compile is an `InvalidRequest` naming the field.
Not guaranteed: JSON Schema keywords xgrammar does not enforce (e.g. `format`, `uniqueItems`,
`multipleOf`) are ignored, as in vLLM; a `choice` list is matched as literal strings.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

import torch

from gapless.serve.protocol import InvalidRequest

StructureKind = Literal["json_object", "json_schema", "regex", "choice", "ebnf"]


@dataclass(frozen=True)
class StructureSpec:
    """What a request's output must match. `value`: the schema as canonical JSON text (json_schema),
    the pattern (regex), the choices as a JSON list (choice), the grammar text (ebnf), '' (json_object).
    `param`: the request field it came from (named in errors)."""

    kind: StructureKind
    value: str = ""
    param: str = "response_format"
    root: str = "root"  # the start rule of an ebnf grammar

    @staticmethod
    def schema(schema: dict, param: str = "response_format") -> StructureSpec:
        return StructureSpec("json_schema", json.dumps(schema, sort_keys=True), param)


# UTF-8 continuation states: (bytes still expected, allowed range of the next byte); (0, ..) = at a boundary
_Utf8State = tuple[int, int, int]
_BOUNDARY: _Utf8State = (0, 0x80, 0xBF)


def _utf8_step(state: _Utf8State, byte: int) -> _Utf8State | None:
    """The state after `byte`, or None if it makes the text invalid UTF-8 (RFC 3629: no overlong
    forms, no surrogates, nothing past U+10FFFF)."""
    left, lo, hi = state
    if left:
        return (left - 1, 0x80, 0xBF) if lo <= byte <= hi else None
    if byte < 0x80:
        return _BOUNDARY
    special = {0xE0: (2, 0xA0, 0xBF), 0xED: (2, 0x80, 0x9F), 0xF0: (3, 0x90, 0xBF), 0xF4: (3, 0x80, 0x8F)}
    if byte in special:
        return special[byte]
    if 0xC2 <= byte <= 0xDF:
        return (1, 0x80, 0xBF)
    if 0xE1 <= byte <= 0xEF:
        return (2, 0x80, 0xBF)
    if 0xF1 <= byte <= 0xF3:
        return (3, 0x80, 0xBF)
    return None


class Utf8Masks:
    """Per UTF-8 state, the bitmask of tokens whose bytes keep the text valid UTF-8."""

    def __init__(self, token_bytes: Sequence[bytes], words: int):
        self._bytes = list(token_bytes)
        self._words = words
        self._masks: dict[_Utf8State, torch.Tensor] = {}
        self._after: dict[tuple[_Utf8State, int], _Utf8State | None] = {}

    def mask(self, state: _Utf8State) -> torch.Tensor:
        if state not in self._masks:  # at most ten states: built on first use
            bits = torch.zeros(self._words * 32, dtype=torch.bool)
            for t in range(len(self._bytes)):
                bits[t] = self.after(state, t) is not None
            weights = 1 << torch.arange(32, dtype=torch.int64)
            packed = (bits.view(self._words, 32).to(torch.int64) * weights).sum(1)  # (words,) in 0..2^32-1
            self._masks[state] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return self._masks[state]

    def after(self, state: _Utf8State, token: int) -> _Utf8State | None:
        key = (state, token)
        if key not in self._after:
            for byte in self._bytes[token] if token < len(self._bytes) else b"":
                if (state := _utf8_step(state, byte)) is None:
                    break
            self._after[key] = state
        return self._after[key]


class GrammarConstraint:
    """One sample's grammar state (a TokenConstraint, generate/constraint.py)."""

    def __init__(self, matcher, utf8: Utf8Masks):
        self._matcher, self._utf8, self._state = matcher, utf8, _BOUNDARY

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self._utf8.mask(self._state)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):  # the bitmask allowed it: a library fault, not the model's
            raise RuntimeError(f"the grammar rejected token {token}, which its own mask allowed")
        self._state = self._utf8.after(self._state, token) or _BOUNDARY

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class CompiledGrammar:
    def __init__(self, compiled, utf8: Utf8Masks):
        self._compiled, self._utf8 = compiled, utf8

    def constraint(self) -> GrammarConstraint:
        import xgrammar

        return GrammarConstraint(xgrammar.GrammarMatcher(self._compiled), self._utf8)


class Grammars:
    """The compiler for one served tokenizer; `compile` is thread-safe and cached per spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int], cache_size: int = 256):
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_ids))
        )
        # one thread: the engine thread and the event loop share few cores; a grammar compiles once per spec
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._utf8 = Utf8Masks(info.decoded_vocab, -(-vocab_size // 32))
        self._lock = threading.Lock()
        self.compile = lru_cache(maxsize=cache_size)(self._compile)

    def _compile(self, spec: StructureSpec) -> CompiledGrammar:
        xgr = self._xgr
        try:
            with self._lock:
                if spec.kind == "json_object":
                    grammar = xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
                elif spec.kind == "json_schema":
                    grammar = xgr.Grammar.from_json_schema(
                        json_safe(json.loads(spec.value)), any_whitespace=False, strict_mode=True
                    )
                elif spec.kind == "regex":
                    grammar = xgr.Grammar.from_regex(spec.value)
                elif spec.kind == "choice":
                    grammar = xgr.Grammar.from_regex("|".join(re.escape(c) for c in json.loads(spec.value)))
                else:
                    grammar = xgr.Grammar.from_ebnf(spec.value, root_rule_name=spec.root)
                return CompiledGrammar(self._compiler.compile_grammar(grammar), self._utf8)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's ways of saying "not this grammar"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", first)[:300]  # the C++ source location is noise here
            raise InvalidRequest(
                f"{spec.param}: cannot build a {spec.kind.replace('_', ' ')} grammar from it ({first})", spec.param
            ) from None


def json_schema_ebnf(schema: dict) -> str:
    """The EBNF (xgrammar's dialect, start rule `root`) of a JSON schema, for composing grammars."""
    import xgrammar

    return str(xgrammar.Grammar.from_json_schema(json_safe(schema), any_whitespace=False, strict_mode=True))


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema, not schemas


def json_safe(schema):
    """`schema` with every length-bounded plain string rewritten as a pattern of JSON string
    characters (no quote, backslash or control character), so its output is valid JSON."""
    if isinstance(schema, list):
        return [json_safe(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: {name: json_safe(sub) for name, sub in v.items()}
        if k in _SCHEMA_MAPS and isinstance(v, dict)
        else json_safe(v)
        for k, v in schema.items()
    }
    values = out.pop("enum") if "enum" in out else [out.pop("const")] if "const" in out else None
    if values is not None:  # xgrammar mis-encodes non-ASCII literals: those become patterns, which it matches right
        options = [_literal(v) for v in values]
        out.update(options[0] if len(options) == 1 else {"anyOf": options})
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = '^[^\\x00-\\x1f"\\\\]{%d,%s}$' % (lo, "" if hi is None else int(hi))
    return out


def _literal(value) -> dict:
    if isinstance(value, str) and not value.isascii() and not re.search(r'["\\\x00-\x1f]', value):
        return {"type": "string", "pattern": "^" + re.escape(value) + "$"}
    return {"const": value}
