"""Tool-call formats parsed from text (no server): the Hermes format's calls and content, streamed in any
split equal to parsed whole, untrusted text never raising, and the forced-call grammar's output always
parsing into calls whose arguments validate."""

from __future__ import annotations

import json

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from gapless.serve.tools.parsers import HERMES, StreamParser, tool_call_format
from gapless.serve.tools.render import plain_messages
from gapless.serve.tools.reply import ToolStream, tool_message

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def test_hermes_calls_and_content():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    message, finish = tool_message(text, "stop", HERMES)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "add"
    assert tool_message(text, "length", HERMES)[1] == "length"
    assert tool_call_format("hermes") is HERMES


def test_broken_blocks_stay_content():
    for text in [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>["add"]</tool_call>',
        '<tool_call>{"name": "add"',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    ]:
        content, calls = HERMES.parse(text)
        assert calls == [] and content == text.strip()
        assert tool_message(text, "stop", HERMES) == ({"role": "assistant", "content": text.strip()}, "stop")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(max_size=20),
            st.sampled_from(
                ["<tool_call>", "</tool_call>", "<tool", "call>", "\n", '{"name": "add", "arguments": {"a": 1}}']
            ),
        ),
        max_size=12,
    ),
    st.lists(st.integers(1, 30), max_size=10),
)
def test_streaming_equals_parsing_for_any_text_and_split(pieces, cuts):
    text = "".join(pieces)
    content, calls = HERMES.parse(text)
    stream, got, chunks, at = ToolStream(HERMES), [], [], 0
    for cut in cuts + [len(text)]:
        chunks.append(text[at : at + cut])
        at += cut
    chunks.append(text[at:])
    streamed = ""
    for i, chunk in enumerate(chunks):
        delta, _ = stream.delta(chunk, "stop" if i == len(chunks) - 1 else None)
        streamed += delta["content"]
        got += delta.get("tool_calls", [])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == [(c.name, c.arguments) for c in calls]
    assert [c["index"] for c in got] == list(range(len(got)))
    assert streamed.strip() == (content or "")


def test_stream_holds_back_a_marker_prefix_only():
    parser = StreamParser(HERMES)
    assert parser.feed("hello <tool") == ("hello ", [])
    assert parser.feed("box>") == ("<toolbox>", [])


def test_history_renders_in_the_format():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "6"},
    ]
    plain = plain_messages(messages, [ADD], HERMES)
    assert [r for r, _ in plain] == ["system", "user", "assistant", "user"]
    assert plain[0][1].startswith("Be brief.\n\n") and json.dumps(ADD) in plain[0][1]
    content, calls = HERMES.parse(plain[2][1])
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert plain[3][1] == "<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.fixed_dictionaries({"a": st.integers(-(10**6), 10**6), "b": st.integers()}), min_size=1, max_size=3),
    st.text(max_size=30).filter(lambda t: "<tool_call>" not in t),
)
def test_rendered_calls_round_trip(args, prefix):
    text = "\n".join([prefix] + [HERMES.render("add", a) for a in args])
    content, calls = HERMES.parse(text)
    assert [json.loads(c.arguments) for c in calls] == args
    assert content == (prefix.strip() or None)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), ADD["function"]["parameters"])
