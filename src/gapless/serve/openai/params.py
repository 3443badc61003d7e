"""The OpenAI request bodies gapless accepts, as strict pydantic models, and their sampling params.

A field gapless serves is validated strictly (`"5"` is not an integer; a value it cannot honour,
such as `best_of` above `n` or an image part, is a 400 naming the field and what it accepts). A
top-level field it does not know -- OpenAI's platform-only fields (`metadata`, `store`,
`service_tier`, `reasoning_effort`, ...) or another server's extension -- is accepted and
ignored, as vLLM does, and logged once per field name; nested objects stay strict.
Extensions beyond OpenAI, compatible with vLLM's names: `return_token_ids` (token-in-token-out,
off by default), `ignore_eos`, `top_k`, `repetition_penalty`, `stop_token_ids`, and the
structured-output fields (structured.py). Tool calling (tools, tool_choice, tool messages) is in
tools/params.py.
"""

from __future__ import annotations

import logging
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gapless.serve.protocol import InvalidRequest
from gapless.serve.structured import StructuredFields
from gapless.serve.tools.params import ToolCallParam, ToolFields
from gapless.types import LogitAdjustment, SamplingParams

log = logging.getLogger("gapless.serve")
MAX_STOPS = 1024  # vLLM sets no limit; this bounds the per-step stop-string search of one sample
REFUSED_PARTS = ("image_url", "input_image", "input_audio", "audio", "file", "video_url")
# fields that would change what a client gets back: refused (400) where not served, never ignored
UNSERVED_FIELDS = ("tools", "tool_choice", "functions", "function_call")
_ignored_logged: set[str] = set()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(_Strict):
    """A request body: unknown top-level fields are kept aside (`model_extra`) and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only

    @model_validator(mode="after")
    def _check_roles(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        for part in value if isinstance(value, list) else ():
            if isinstance(part, dict) and part.get("type") in REFUSED_PARTS:
                raise ValueError(
                    f"content parts of type {part['type']!r} are not supported: the served model reads "
                    "text only; send 'text' parts"
                )
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def as_dict(self) -> dict:
        """The message as an OpenAI-shaped dict with text content (tool rendering, tools/render.py)."""
        out = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _Sampling(StructuredFields, _Body):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)  # unknown top-level fields: ignored (_Body)

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> a value in [-100, 100] added to its logit."""
    user: str | None = None  # accepted and unused (it is metadata for OpenAI's abuse monitoring)
    # extensions (vLLM's names)
    return_token_ids: bool = False
    """Token-in-token-out: each choice carries prompt_token_ids, token_ids, sampling_logprobs and
    policy_versions (streamed: prompt ids in a choice's first chunk, the rest per chunk)."""
    ignore_eos: bool = False
    top_k: int = Field(0, ge=0)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    stop_token_ids: list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS or not all(stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids written as strings (got {key!r})")
            if not -100 <= bias <= 100:
                raise ValueError(f"values lie in [-100, 100] (got {bias} for token {key})")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling(self, max_new_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        """The engine's params; `vocab_size` checks the token ids of logit_bias and stop_token_ids."""
        temperature = 1.0 if self.temperature is None else self.temperature
        bias = tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        for field, ids in (("logit_bias", [t for t, _ in bias]), ("stop_token_ids", self.stop_token_ids or [])):
            if vocab_size is not None and (bad := [t for t in ids if not 0 <= t < vocab_size]):
                raise InvalidRequest(
                    f"{field}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", field
                )
        adjust = LogitAdjustment(
            bias,
            self.presence_penalty or 0.0,
            self.frequency_penalty or 0.0,
            1.0 if self.repetition_penalty is None else self.repetition_penalty,
        )
        return SamplingParams(
            temperature=temperature or 1.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            greedy=temperature == 0.0,
            max_new_tokens=max_new_tokens,
            seed=random.getrandbits(62) if self.seed is None else self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            adjust=None if adjust.is_identity else adjust,
        )


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _check(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported (no server-side ranking); leave it out")
        if not self.prompt:
            raise ValueError("prompt is empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 only scores the prompt: it needs echo=true")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens=0 (scoring the prompt) cannot be streamed")
        if self.stream and self.logprobs:
            raise ValueError("logprobs > 0 (top alternatives) cannot be streamed; use logprobs=0 or stream=false")
        return self


class ChatBody(_Sampling, ToolFields):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown top-level fields: ignored (_Body)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self):
        if self.forced_tools is not None and self.structure_spec() is not None:
            raise ValueError(
                "tool_choice required or named already constrains the reply; drop the structured-output field"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.stream and self.top_logprobs:
            raise ValueError("top_logprobs > 0 cannot be streamed; use stream=false")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(model: type[_Strict], body: object) -> _Strict:
    """Validate a decoded JSON body; the first problem becomes an `InvalidRequest` naming its field.
    Unknown top-level fields are ignored, each name logged once per process."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
        if unserved := [name for name in UNSERVED_FIELDS if name in (parsed.model_extra or {})]:
            raise InvalidRequest(f"unsupported parameter: {unserved[0]}", unserved[0])
        for name in (parsed.model_extra or {}).keys() - _ignored_logged:
            _ignored_logged.add(name)
            log.warning("ignoring the request field %r (not used by this server)", name)
        return parsed
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise InvalidRequest(f"unsupported parameter: {param}", param) from None
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {message}" if param else message, param) from None
