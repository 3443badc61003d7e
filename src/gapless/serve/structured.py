"""The request fields that ask for structured output, and the one `StructureSpec` they make.

    response_format      {"type": "text" | "json_object"}
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs   vLLM's: {"json": schema | text, "regex", "choice": [...], "grammar": EBNF, "json_object": true}
    guided_json, guided_regex, guided_choice, guided_grammar    vLLM's older names of the same

At most one of them may constrain a request (two are a 400 naming the second). `strict` is accepted
either way: a schema is always enforced by the grammar, so strict and non-strict outputs are the
same. Also accepted and ignored, as vLLM does: `guided_decoding_backend` (the server has one).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gapless.serve.grammar import StructureSpec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a 'schema'")
        return self


class StructuredOutputs(_Strict):
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(_Strict):
    """Mixed into the completions and chat bodies (openai/params.py)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: this server has one backend

    @model_validator(mode="after")
    def _one_structure(self):
        self.structure_spec()  # its ValueErrors become the 400 naming the field
        return self

    def structure_spec(self) -> StructureSpec | None:
        specs = []
        if (rf := self.response_format) is not None and rf.type != "text":
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            specs.append(StructureSpec("json_object") if schema is None else StructureSpec.schema(schema))
        if (so := self.structured_outputs) is not None:
            given = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
            if len(given) != 1:
                raise ValueError(
                    f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object "
                    f"(got {sorted(given) or 'none'})"
                )
            [(key, value)] = given.items()
            specs.append(_spec(key, value, f"structured_outputs.{key}"))
        for key in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{key}")) is not None:
                specs.append(_spec(key, value, f"guided_{key}"))
        if len(specs) > 1:
            raise ValueError(
                f"{specs[1].param}: a request takes one structured-output constraint; {specs[0].param} already sets one"
            )
        return specs[0] if specs else None


def _spec(key: str, value: Any, param: str) -> StructureSpec:
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{param} is not a JSON schema: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{param} must be a JSON schema object")
        return StructureSpec("json_schema", json.dumps(value, sort_keys=True), param)
    if key == "json_object":
        return StructureSpec("json_object", "", param)
    if key == "regex":
        return StructureSpec("regex", value, param)
    if key == "choice":
        return StructureSpec("choice", json.dumps(value), param)
    return StructureSpec("ebnf", value, param)
