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
own length rule lets control characters through). JSON is generated without
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


class GrammarConstraint:
    """One sample's grammar state (a TokenConstraint, generate/constraint.py)."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):  # the bitmask allowed it: a library fault, not the model's
            raise RuntimeError(f"the grammar rejected token {token}, which its own mask allowed")

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class CompiledGrammar:
    def __init__(self, compiled):
        self._compiled = compiled

    def constraint(self) -> GrammarConstraint:
        import xgrammar

        return GrammarConstraint(xgrammar.GrammarMatcher(self._compiled))


class Grammars:
    """The compiler for one served tokenizer; `compile` is thread-safe and cached per spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int], cache_size: int = 256):
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_ids)))
        # one thread: the engine thread and the event loop share few cores; a grammar compiles once per spec
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()
        self.compile = lru_cache(maxsize=cache_size)(self._compile)

    def _compile(self, spec: StructureSpec) -> CompiledGrammar:
        xgr = self._xgr
        try:
            with self._lock:
                if spec.kind == "json_object":
                    grammar = xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
                elif spec.kind == "json_schema":
                    grammar = xgr.Grammar.from_json_schema(json_safe(json.loads(spec.value)), any_whitespace=False,
                                                           strict_mode=True)
                elif spec.kind == "regex":
                    grammar = xgr.Grammar.from_regex(spec.value)
                elif spec.kind == "choice":
                    grammar = xgr.Grammar.from_regex("|".join(re.escape(c) for c in json.loads(spec.value)))
                else:
                    grammar = xgr.Grammar.from_ebnf(spec.value, root_rule_name=spec.root)
                return CompiledGrammar(self._compiler.compile_grammar(grammar))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's ways of saying "not this grammar"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", first)[:300]  # the C++ source location is noise here
            raise InvalidRequest(f"{spec.param}: cannot build a {spec.kind.replace('_', ' ')} grammar from it ({first})",
                                 spec.param) from None


def json_schema_ebnf(schema: dict) -> str:
    """The EBNF (xgrammar's dialect, start rule `root`) of a JSON schema, for composing grammars."""
    import xgrammar

    return str(xgrammar.Grammar.from_json_schema(json_safe(schema), any_whitespace=False, strict_mode=True))


def json_safe(schema):
    """`schema` with every length-bounded plain string rewritten as a pattern of JSON string
    characters (no quote, backslash or control character), so its output is valid JSON."""
    if isinstance(schema, list):
        return [json_safe(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_safe(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = "^[^\\x00-\\x1f\"\\\\]{%d,%s}$" % (lo, "" if hi is None else int(hi))
    return out
