"""The Responses API (`/v1/responses`) driven by the official `openai` client: text, function tools
(forced and in history), streamed items equal to the final response, structured `text.format`, and
what is refused by name. Answers are compared with /v1/chat/completions, the path it shares."""

from __future__ import annotations

import json
from typing import Annotated

import openai
import pytest
import torch
from pydantic import BaseModel, Field
from serve_model import tiny_policy

from gapless.serve.openai.server import ServerThread, build_app

PROMPT = "Question 3: name"
Small = Annotated[int, Field(ge=0, le=99)]  # bounded: a random model writes digits for as long as it may
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}
NEGATE = {
    "type": "function",
    "name": "negate",
    "parameters": {"type": "object", "properties": {"x": ADD["parameters"]["properties"]["a"]}, "required": ["x"]},
}
SEEDED = dict(model="tiny", max_output_tokens=120, temperature=0)


class Sum(BaseModel):
    total: Small
    sure: bool


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    srv = ServerThread(build_app(tiny_policy(max_positions=1024), "tiny", max_batch=16, max_samples=64))
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    srv.close()


def test_text_equals_chat_and_streams_the_same(client):
    out = client.responses.create(input=PROMPT, instructions="Answer briefly.", **{**SEEDED, "max_output_tokens": 10})
    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=10,
        temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": PROMPT}],
    )
    assert out.output_text == chat.choices[0].message.content
    assert (
        out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == chat.usage.completion_tokens
    )
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(
        input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
        instructions="Answer briefly.",
        **{**SEEDED, "max_output_tokens": 10},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == out.output_text


def test_forced_function_calls_are_valid_items(client):
    named = client.responses.create(
        input="What is 2 + 3?", tools=[ADD, NEGATE], tool_choice={"type": "function", "name": "add"}, **SEEDED
    )
    calls = [item for item in named.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["add"] and named.status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    single = client.responses.create(
        input="Use a tool.", tools=[ADD, NEGATE], tool_choice="required", parallel_tool_calls=False, **SEEDED
    )
    assert [item.type for item in single.output] == ["function_call"]
    assert single.output[0].name in {"add", "negate"}


def test_streamed_calls_are_the_final_items(client):
    kwargs = dict(input="What is 2 + 3?", tools=[ADD], tool_choice="required", **SEEDED)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [e.arguments for e in done] == [i.arguments for i in final.output if i.type == "function_call"]
    assert [i.id for i in added] == [i.id for i in final.output]
    strip = lambda items: [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in items]  # noqa: E731
    assert strip(final.output) == strip(plain.output)
    seq = [e.sequence_number for e in events]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)


def test_history_with_calls_renders_as_chat_does(client):
    items = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    out = client.responses.create(input=items, tools=[ADD], **{**SEEDED, "max_output_tokens": 4})
    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=4,
        temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
        messages=[
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
    )
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens


def test_text_format_json_schema_parses(client):
    out = client.responses.parse(input="What is 2 + 3?", text_format=Sum, **{**SEEDED, "max_output_tokens": 200})
    assert isinstance(out.output_parsed, Sum)
    loose = client.responses.create(
        input="Give JSON.", text={"format": {"type": "json_object"}}, **{**SEEDED, "max_output_tokens": 200}
    )
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
        ({"tools": [ADD], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "add"}]}, "input.0.arguments"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)
def test_refusals_name_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"input": "x", "model": "tiny", **kwargs})
    body = refused.value.body  # a check across fields names its field at the start of the message
    assert body["param"] == param or body["message"].startswith(f"{param}:"), body
