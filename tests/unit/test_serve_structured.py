"""Structured outputs by grammar-constrained decoding (xgrammar) inside the engine's batch: any JSON schema
from a generator gives valid output or an explicit length cut; a constrained neighbour leaves an
unconstrained row's tokens unchanged; the served API (openai client's `parse`, json_object, vLLM's regex
and choice extras, streams, errors) on a real server over a tiny random model."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from serve_model import tiny_policy

from gapless.generate.engine import TorchEngine
from gapless.generate.sampling import sample_seed
from gapless.serve.grammar import Grammars, StructureSpec
from gapless.serve.openai.server import ServerThread, build_app
from gapless.types import Completion, SamplingParams


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return tiny_policy(max_positions=512)


@pytest.fixture(scope="module")
def grammars(policy):
    return Grammars(policy.tokenizer, policy.model.config.vocab_size, [policy.eos_id])


def _run(engine: TorchEngine, prompt: list[int], params: SamplingParams, constraints: list) -> list[Completion]:
    """One sample per constraint (None = unconstrained), all in one batch; results in order."""
    for j, constraint in enumerate(constraints):
        fresh = Completion(list(prompt), [], [], [], "abort", "", f"r{j}", 0, sample_seed(params.seed, j))
        engine.resume([fresh], params, f"r{j}", constraints=[constraint])
    done = {}
    while engine.has_work:
        done.update((c.request_id, c) for c in engine.step())
    return [done[f"r{j}"] for j in range(len(constraints))]


# ---- schemas from a generator -----------------------------------------------------------------
_leaf = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "string"}),
    st.lists(st.text('abc xyz"\\é', min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    ),
)


def _object(children):
    return st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), children, min_size=0, max_size=3).flatmap(
        lambda props: (
            st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}
            )
            if props
            else st.just({"type": "object", "properties": {}, "additionalProperties": False})
        )
    )


SCHEMAS = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=6,
).map(
    lambda s: (
        s
        if s.get("type") in ("object", "array")
        else {"type": "object", "properties": {"v": s}, "required": ["v"], "additionalProperties": False}
    )
)


@settings(
    max_examples=int(os.environ.get("GAPLESS_SCHEMA_EXAMPLES", 25)),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**20))
def test_any_schema_gives_valid_json_or_a_length_cut(policy, grammars, schema, seed):
    engine = TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=4, max_seq_len=512)
    grammar = grammars.compile(StructureSpec.schema(schema))
    prompt = policy.tokenizer.encode("Question 3: name", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=seed)
    for out in _run(engine, prompt, params, [grammar.constraint(), grammar.constraint()]):
        text = policy.decode(out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == policy.eos_id
            jsonschema.validate(json.loads(text), schema)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 48


def test_unconstrained_rows_are_untouched(policy, grammars):
    prompt = policy.tokenizer.encode("Question 5: name", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11, ignore_eos=True)
    alone = _run(TorchEngine(policy.model, policy.eos_id, max_batch=4), prompt, params, [None])
    grammar = grammars.compile(StructureSpec("regex", r"[a-c]{3,30}"))
    mixed = _run(TorchEngine(policy.model, policy.eos_id, max_batch=4), prompt, params, [None, grammar.constraint()])
    assert mixed[0].token_ids == alone[0].token_ids
    assert re.fullmatch(
        r"[a-c]{3,30}",
        policy.decode(mixed[1].token_ids[:-1] if mixed[1].finish_reason == "stop" else mixed[1].token_ids),
    )
    # the constrained row's log-probs are under the masked distribution: higher than unmasked ones on average
    assert all(lp <= 0.0 for lp in mixed[1].logprobs)


# ---- served -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(policy):
    srv = ServerThread(build_app(policy, "tiny", max_batch=16, max_samples=64))
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.close()


class Fruit(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=100)
    ripe: bool


MESSAGES = [{"role": "user", "content": "Name a fruit."}]


def test_parse_and_json_modes(client):
    for seed in range(3):
        out = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Fruit, max_tokens=64, seed=seed
        )
        assert out.choices[0].finish_reason == "stop" and isinstance(out.choices[0].message.parsed, Fruit)
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=64, seed=1, n=3
    )
    for choice in out.choices:
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)


def test_regex_choice_and_json_extras_on_completions(client):
    out = client.completions.create(
        model="tiny", prompt="Question 1:", max_tokens=20, n=4, seed=2, extra_body={"guided_regex": r"[a-z]{3}-\d\d"}
    )
    assert all(c.finish_reason == "stop" and re.fullmatch(r"[a-z]{3}-\d\d", c.text) for c in out.choices)
    out = client.completions.create(
        model="tiny",
        prompt="Question 1:",
        max_tokens=20,
        n=6,
        seed=3,
        extra_body={"structured_outputs": {"choice": ["apple", "red cat"]}},
    )
    assert {c.text for c in out.choices} <= {"apple", "red cat"} and {c.finish_reason for c in out.choices} == {"stop"}
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    out = client.completions.create(
        model="tiny", prompt="Question 1:", max_tokens=20, seed=4, extra_body={"guided_json": schema}
    )
    jsonschema.validate(json.loads(out.choices[0].text), schema)


def test_a_length_cut_says_so_and_streams_match(client):
    schema = {
        "type": "object",
        "properties": {"words": {"type": "array", "items": {"type": "string"}}},
        "required": ["words"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=12, seed=5)
    content = out.choices[0].message.content
    assert out.choices[0].finish_reason == "length" and content.startswith('{"words": ["')  # cut mid-structure
    with pytest.raises(ValueError):
        json.loads(content)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=12, seed=5, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content


def test_bad_constraints_are_400s_naming_the_field(client):
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "(("}}, "guided_regex"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kw)
        assert field in err.value.body["message"], err.value.body
