"""Tool calling served the way vLLM serves it, driven by the official `openai` client over a real server
on a tiny random model: `required` and named choices forced valid by the grammar (one call, or several
with parallel_tool_calls), streamed tool-call deltas equal to the plain reply, history with assistant
tool_calls and tool messages, `auto` parsing the model's own text (made to write a call by a regex
constraint, the only honest way to get one from a random model), and refusals naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from serve_model import tiny_policy

from gapless.serve.openai.server import ServerThread, build_app

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
CITY = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}
TOOLS = [ADD, CITY]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    srv = ServerThread(build_app(tiny_policy(max_positions=1024), "tiny", max_batch=16, max_samples=64))
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.close()


def _valid(call) -> None:
    tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_required_and_named_choices_give_valid_calls(client):
    for seed in range(4):
        out = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=96,
            seed=seed,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])
    out = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=96,
        seed=7,
        n=3,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    for choice in out.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["weather"]
        _valid(choice.message.tool_calls[0])


def test_parallel_calls_and_streamed_deltas(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=[ADD], tool_choice="required", max_tokens=200, seed=3)
    plain = client.chat.completions.create(**kw)
    calls = plain.choices[0].message.tool_calls or []
    if plain.choices[0].finish_reason == "tool_calls":
        assert len(calls) >= 1
    for call in calls:
        _valid(call)
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == plain.choices[0].finish_reason
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


def test_history_with_tool_results_and_auto_parsing(client):
    first = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=96,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    # auto: the model's own text is parsed; a regex makes this random model write one call of the format
    forced_text = r'<tool_call>\n\{"name": "weather", "arguments": \{"city": "[a-z]{1,6}"\}\}\n</tool_call>'
    out = client.chat.completions.create(
        model="tiny",
        messages=history,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=96,
        seed=2,
        extra_body={"guided_regex": forced_text, "return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == ["weather"]
    _valid(choice.message.tool_calls[0])
    prompt_text = (
        client.completions.create(model="tiny", prompt=choice.model_extra["prompt_token_ids"], max_tokens=1, echo=True)
        .choices[0]
        .text
    )
    assert "<tool_response>\n5\n</tool_response>" in prompt_text and '"name": "add"' in prompt_text
    assert '"name": "weather"' in prompt_text  # the tools listing
    # without tools in the request the same text is plain content
    plain = client.chat.completions.create(
        model="tiny", messages=history, max_tokens=96, seed=2, extra_body={"guided_regex": forced_text}
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content.startswith("<tool_call>")


def test_refusals_name_the_field(client):
    cases = [
        (dict(tools=[{"type": "web_search"}]), "tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kw)
        assert field in err.value.body["message"], err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "tool", "content": "5"}])
    assert "tool_call_id" in err.value.body["message"]
