"""The OpenAI-compatible server driven by the official `openai` client (and raw HTTP where the client
cannot misbehave): completions and chat, streams, n, stop with exact usage, errors as the client's
own exception types, disconnects that free the engine, keep-alive after errors, token-in-token-out.
The server is real (uvicorn on a loopback port, one scheduler over a TorchEngine of a tiny model)."""

from __future__ import annotations

import copy
import http.client
import json
import socket
import time

import openai
import pytest
import torch
from serve_model import tiny_policy

from gapless.generate.engine import TorchEngine
from gapless.serve.openai.app import OpenAIApp
from gapless.serve.openai.server import ServerThread, build_app
from gapless.serve.protocol import SampleRequest
from gapless.types import SamplingParams

PROMPT = "Question 3: name"


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    policy = tiny_policy()
    srv = ServerThread(build_app(policy, "tiny", max_batch=32, max_samples=64))
    yield srv, policy
    srv.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0].url, api_key="unused", max_retries=0, timeout=60)


def _idle(scheduler, timeout_s: float = 30.0) -> bool:
    """Wait (bounded) until the scheduler holds nothing; returns whether it got there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if scheduler.num_handles == 0 and scheduler.samples_in_flight == 0 and not scheduler.engine.has_work:
            return True
        time.sleep(0.01)
    return False


def test_completions_and_chat(server, client):
    out = client.completions.create(
        model="tiny", prompt=[PROMPT, "Question 4:"], max_tokens=12, n=2, seed=3, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    lengths = [len(c.model_extra["token_ids"]) for c in out.choices]
    prompt_lengths = {len(c.model_extra["prompt_token_ids"]) for c in out.choices}
    assert out.usage.completion_tokens == sum(lengths) and out.usage.prompt_tokens == sum(prompt_lengths)
    assert out.choices[0].text != out.choices[1].text  # sample j has its own stream
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=8, seed=1
    )
    parts = client.chat.completions.create(
        model="tiny",
        max_tokens=8,
        seed=1,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    )
    joined = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi\nthere"}], max_tokens=8, seed=1
    )
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"


def test_streams_equal_the_plain_responses(server, client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, n=2, seed=5)
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert all(c.object == "text_completion" and c.usage is None for c in chunks)
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    messages = [{"role": "user", "content": "Name a fruit."}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=2)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, seed=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage == plain.usage and all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == [
        plain.choices[0].finish_reason
    ]


def test_stop_ends_decoding_with_exact_usage(server, client):
    kw = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0]
    stop = full.text[6:9]
    assert stop and stop in full.text
    out = client.completions.create(**kw, stop=[stop, "never-written"], logprobs=0)
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.finish_reason == "stop" and choice.text == full.text[: full.text.find(stop)]
    assert out.usage.completion_tokens == len(ids) < 40 and ids == full.model_extra["token_ids"][: len(ids)]
    assert len(choice.logprobs.token_logprobs) == len(ids) == len(choice.model_extra["sampling_logprobs"])
    streamed = list(client.completions.create(**kw, stop=stop, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[-1].usage.completion_tokens == len(ids)


def test_errors_are_the_clients_own_exceptions(server, client):
    srv, _ = server
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, temperature="hot")
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="tools"):  # OpenAI's built-in tools run on OpenAI's side
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], tools=[{"type": "web_search"}]
        )
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny", prompt=PROMPT, presence_penalty=5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    submitted = srv.app.scheduler.stats.submitted
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="Question " * 200_000, max_tokens=8)  # ~1.8 MB, context 256
    assert long.value.code == "context_length_exceeded" and srv.app.scheduler.stats.submitted == submitted
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Question " * 200_000}])
    assert long.value.code == "context_length_exceeded" and srv.app.scheduler.stats.submitted == submitted
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt=list(range(250)), max_tokens=8)
    assert long.value.code == "context_length_exceeded"
    srv.app.api_key = "secret"
    try:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt=PROMPT)
        keyed = openai.OpenAI(base_url=srv.url, api_key="secret", max_retries=0)
        assert keyed.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices
    finally:
        srv.app.api_key = None
    srv.app.max_body_bytes = 1000
    try:
        with pytest.raises(openai.APIStatusError) as big:
            client.completions.create(model="tiny", prompt="x" * 2000)
        assert big.value.status_code == 413
    finally:
        srv.app.max_body_bytes = 16 << 20


def test_a_full_queue_answers_429(server, client):
    srv, policy = server
    hog = srv.app.scheduler.submit(
        SampleRequest(tuple(policy.encode(PROMPT)), SamplingParams(max_new_tokens=240, ignore_eos=True), n=64)
    )
    try:
        with pytest.raises(openai.RateLimitError) as full:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert full.value.response.headers["retry-after"] == "1"
    finally:
        hog.abort()
    assert _idle(srv.app.scheduler)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices  # it survived


def test_disconnects_free_the_engine(server, client):
    srv, _ = server
    scheduler = srv.app.scheduler
    aborted = scheduler.stats.aborted_samples
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=240, n=8, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    assert _idle(scheduler) and scheduler.stats.aborted_samples > aborted
    aborted = scheduler.stats.aborted_samples
    host, port = srv.url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "n": 32, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as sock:  # a non-streaming client that hangs up
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.05)
    assert _idle(scheduler) and scheduler.stats.aborted_samples > aborted
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices


def test_keep_alive_connection_survives_errors(server):
    srv, _ = server
    host, port = srv.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    requests = [
        ("POST", "/v1/nowhere", b'{"a": 1}', 404),
        ("POST", "/v1/completions", b"{not json", 400),
        ("GET", "/v1/completions", b"", 405),
        ("POST", "/v1/completions", b'{"prompt": ""}', 400),
        ("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 3}).encode(), 200),
    ]
    conn.connect()
    first_socket = conn.sock
    for method, path, body, status in requests:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = json.loads(response.read())
        assert response.status == status and (status == 200 or set(payload["error"]) >= {"message", "type", "code"})
    assert conn.sock is first_socket  # one connection throughout
    conn.close()


def test_token_in_token_out(server, client):
    srv, policy = server
    prompt = policy.encode(PROMPT)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, n=2, seed=11, temperature=0.9, extra_body={"return_token_ids": True}
    )
    engine = TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=8)
    engine.add_request(prompt, SamplingParams(temperature=0.9, max_new_tokens=20, seed=11), n=2)
    own = {}
    while engine.has_work:
        own.update((c.index, c) for c in engine.step())
    for choice in out.choices:
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt and extra["token_ids"] == own[choice.index].token_ids
        assert extra["sampling_logprobs"] == pytest.approx(own[choice.index].logprobs, abs=1e-4)
        assert extra["policy_versions"] == [0] * len(extra["token_ids"])
    greedy = dict(model="tiny", max_tokens=20, temperature=0, extra_body={"return_token_ids": True})
    by_text = client.completions.create(prompt=PROMPT, **greedy).choices[0]
    by_ids = client.completions.create(prompt=by_text.model_extra["prompt_token_ids"], **greedy).choices[0]
    assert by_ids.model_extra["token_ids"] == by_text.model_extra["token_ids"] and by_ids.text == by_text.text
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert echo.choices[0].text == PROMPT and echo.choices[0].logprobs.token_logprobs[0] is None
    assert len(echo.choices[0].logprobs.tokens) == len(prompt)


def test_chat_uses_the_tokenizers_template(server):
    srv, policy = server
    tokenizer = copy.deepcopy(policy.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}"
    )
    templated = ServerThread(OpenAIApp(srv.app.scheduler, tokenizer, "tiny"))  # a second app over the same scheduler
    try:
        client = openai.OpenAI(base_url=templated.url, api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
        out = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
        )
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.choices[0].model_extra["prompt_token_ids"] == list(expected)
        assert out.choices[0].model_extra["prompt_token_ids"].count(policy.pad_id) == 3  # the template's own, no more
    finally:
        templated.close(scheduler=False)
