"""The rest of the served surface, driven by the official `openai` client (and plain HTTP for the
routes it has no method for): log-prob lists that hold the EOS, logit bias and penalties applied
per request inside one batch, fields the client's platform sends that are ignored, long stop
lists, /tokenize and /detokenize, Prometheus /metrics, image parts refused."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_model import tiny_policy

from gapless.generate.logit_adjust import apply_adjustments
from gapless.serve.openai.server import ServerThread, build_app
from gapless.types import LogitAdjustment

PROMPT = "Question 3: name"


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    policy = tiny_policy()
    srv = ServerThread(build_app(policy, "tiny", max_batch=16, max_samples=64))
    yield srv, policy
    srv.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0].url, api_key="unused", max_retries=0, timeout=60)


def _root(server) -> str:
    return server[0].url.removesuffix("/v1")


def test_adjustments_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adj = LogitAdjustment(logit_bias=((3, 5.0),), presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = apply_adjustments(logits, [(0, adj, [1], [0, 0, 2])])
    # token 0: 2/2 (seen, positive) - 0.25*2 - 0.5 = 0;  token 1: -1*2 (seen in the prompt, negative) = -2
    # token 2: 0.5/2 - 0.25 - 0.5 = -0.5;  token 3: unseen, +5 = 5;  row 1 untouched
    assert out[0].tolist() == pytest.approx([0.0, -2.0, -0.5, 5.0])
    assert torch.equal(out[1], logits[1]) and torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 0.0]))


def test_eos_is_listed_in_log_probs(server, client):
    _, policy = server
    ban_all_but_eos = {str(t): -100 for t in range(len(policy.tokenizer)) if t != policy.eos_id}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True, logit_bias=ban_all_but_eos
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == PROMPT  # the EOS spells no text ...
    assert choice.logprobs.tokens[-1] == "<|eos|>" and len(choice.logprobs.token_logprobs) == out.usage.total_tokens
    assert choice.logprobs.top_logprobs[-1] is not None  # ... but is the last log-prob entry, as OpenAI/vLLM list it
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        logit_bias=ban_all_but_eos,
    )
    assert [c.token for c in chat.choices[0].logprobs.content] == ["<|eos|>"] and chat.choices[0].message.content == ""
    streamed = [
        c
        for c in client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            logprobs=0,
            logit_bias=ban_all_but_eos,
            stream=True,
        )
        if c.choices
    ]
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == ["<|eos|>"]


def test_bias_and_penalties_apply_per_request_inside_one_batch(server, client):
    srv, policy = server
    greedy = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    plain = client.completions.create(**greedy).choices[0].model_extra["token_ids"]
    first = plain[0]
    banned = client.completions.create(**greedy, logit_bias={str(first): -100}).choices[0].model_extra["token_ids"]
    assert banned[0] != first
    forced = client.completions.create(**greedy, logit_bias={"7": 100}).choices[0].model_extra["token_ids"]
    assert forced == [7] * 12
    repeated = max(set(plain), key=plain.count)
    assert plain.count(repeated) > 1  # the tiny model repeats itself: what penalties are for
    penalised = (
        client.completions.create(**greedy, frequency_penalty=2.0, presence_penalty=2.0)
        .choices[0]
        .model_extra["token_ids"]
    )
    assert max(map(penalised.count, set(penalised))) < max(map(plain.count, set(plain)))
    rep = client.completions.create(**{**greedy, "extra_body": {**greedy["extra_body"], "repetition_penalty": 5.0}})
    assert rep.choices[0].model_extra["token_ids"] != plain
    # one batch: a biased request beside plain ones leaves theirs unchanged, and gets its own bias
    steps = srv.app.scheduler.stats.steps
    with httpx.Client(timeout=60) as http:
        import concurrent.futures as cf

        def body(**kw):
            return {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, **kw}  # fmt: skip

        with cf.ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(http.post, f"{srv.url}/completions", json=b)
                for b in (
                    body(),
                    body(logit_bias={"7": 100}),
                    body(),
                    body(frequency_penalty=2.0, presence_penalty=2.0),
                )
            ]
            got = [f.result().json()["choices"][0]["token_ids"] for f in futures]
    assert got == [plain, [7] * 12, plain, penalised]
    assert srv.app.scheduler.stats.steps - steps < 4 * 12  # they shared engine steps
    with pytest.raises(openai.BadRequestError, match="logit_bias: token id"):
        client.completions.create(**greedy, logit_bias={str(len(policy.tokenizer)): 1})


def test_platform_fields_are_ignored_and_stop_lists_are_long(server, client):
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        metadata={"run": "x"},
        store=False,
        service_tier="auto",
        reasoning_effort="low",
        stop=[f"zz{i}" for i in range(16)],
        extra_body={"some_other_servers_field": 1},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=["\n\n", "Question", "zzz", "!!", "<|eos|>"]
    )  # lm-eval: 4 stops and the EOS text
    assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="unsupported parameter: functions"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"functions": [{"name": "f"}]}
        )


def test_image_parts_are_refused_by_name(server, client):
    with pytest.raises(openai.BadRequestError, match="'image_url' are not supported"):
        client.chat.completions.create(
            model="tiny",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ],
        )
    with pytest.raises(openai.BadRequestError, match="'input_image' are not supported"):
        client.responses.create(
            model="tiny", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        )


def test_tokenize_detokenize_and_metrics(server, client):
    srv, policy = server
    with httpx.Client(base_url=_root(server), timeout=30) as http:
        got = http.post("/tokenize", json={"prompt": "a  b\tc", "return_token_strs": True}).json()
        assert got["tokens"] == policy.tokenizer.encode("a  b\tc") and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == srv.app.scheduler.max_seq_len and "".join(got["token_strs"])
        assert http.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": "a  b\tc"}
        messages = [{"role": "user", "content": "hi"}]
        count = http.post("/tokenize", json={"messages": messages}).json()["count"]
        assert (
            count == client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens
        )
        assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
        metrics = http.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    assert families["gapless_requests_submitted"].samples[0].value == srv.app.scheduler.stats.submitted > 0
    assert families["gapless_generation_tokens"].samples[0].value > 0
