"""The OpenAI request bodies gapless accepts, as strict pydantic models, and their sampling params.

Every field of OpenAI's completions and chat-completions requests is either served or refused:
an unknown or unsupported field is a 400 naming it (`extra="forbid"`), and a supported field set to
a value gapless cannot honour (a non-zero penalty, `best_of` above `n`, tools, non-text content
parts) is a 400 naming the field and what it accepts. Types are strict (`"5"` is not an integer).
Extensions beyond OpenAI, compatible with vLLM's names: `return_token_ids` (token-in-token-out,
off by default), `ignore_eos`, `top_k`, and the structured-output fields (structured.py).
Tool calling (tools, tool_choice, tool messages) is in tools/params.py.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gapless.serve.protocol import InvalidRequest
from gapless.serve.structured import StructuredFields
from gapless.serve.tools.params import ToolCallParam, ToolFields
from gapless.types import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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


class _Sampling(StructuredFields):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and unused (it is metadata for OpenAI's abuse monitoring)
    # extensions (vLLM's names)
    return_token_ids: bool = False
    """Token-in-token-out: each choice carries prompt_token_ids, token_ids, sampling_logprobs and
    policy_versions (streamed: prompt ids in a choice's first chunk, the rest per chunk)."""
    ignore_eos: bool = False
    top_k: int = Field(0, ge=0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value not in (None, 0, 0.0):
            raise ValueError("penalties are not supported; send 0 or leave the field out")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported; leave it out")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(temperature=temperature or 1.0, top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=self.top_k, greedy=temperature == 0.0, max_new_tokens=max_new_tokens,
                              seed=random.getrandbits(62) if self.seed is None else self.seed, ignore_eos=self.ignore_eos)


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
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self):
        if self.forced_tools is not None and self.structure_spec() is not None:
            raise ValueError("tool_choice required or named already constrains the reply; drop the structured-output field")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.stream and self.top_logprobs:
            raise ValueError("top_logprobs > 0 cannot be streamed; use stream=false")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(model: type[_Strict], body: object) -> _Strict:
    """Validate a decoded JSON body; the first problem becomes an `InvalidRequest` naming its field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise InvalidRequest(f"unsupported parameter: {param}", param) from None
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {message}" if param else message, param) from None
