"""One sample as a streamed OpenAI completions request to a vLLM server, and its chunks.

`request_body` maps gapless `SamplingParams` onto vLLM's `/v1/completions` fields: the prompt as
token ids, `n = 1`, `logprobs = 0` (the sampled token's log-prob only), `return_token_ids` (each
chunk carries its token ids, so no text is decoded or re-encoded), the sample's seed, stop token
ids, and vLLM's own names for penalties and logit bias. `stream` posts it and puts one `Chunk` per
server-sent event into a queue, then an end marker, or one error chunk (an HTTP status other than
200, an error event, a dropped connection). Cancelling `stream` closes the connection, which makes
the server abort the request.

Guaranteed: the chunks of one request arrive in order, and `end` or `error` comes last. Not
guaranteed: a chunk's tokens are whatever the server batched into one event (one or more).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

from gapless.types import SamplingParams


@dataclass
class Chunk:
    sample: object  # the engine's record of the sample, passed through
    submission: int  # which of the sample's requests sent it
    token_ids: list[int]
    logprobs: list[float]
    finish: str | None = None  # the server's finish reason ('stop', 'length', 'abort')
    end: bool = False  # the stream closed
    error: str | None = None


def request_body(
    model: str, prompt: list[int], p: SamplingParams, max_tokens: int, seed: int, stop_ids: frozenset[int]
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0 if p.greedy else p.temperature,
        "top_p": 1.0 if p.greedy else p.top_p,
        "seed": seed,
        "stop_token_ids": sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else stop_ids)),
        "ignore_eos": p.ignore_eos,
        "logprobs": 0,
        "return_token_ids": True,
        "stream": True,
    }
    if p.top_k > 0 and not p.greedy:
        body["top_k"] = p.top_k
    if p.adjust is not None and not p.adjust.is_identity:  # types.LogitAdjustment, in vLLM's names
        a = p.adjust
        body.update(
            presence_penalty=a.presence_penalty,
            frequency_penalty=a.frequency_penalty,
            repetition_penalty=a.repetition_penalty,
        )
        if a.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in dict(a.logit_bias).items()}
    return body


async def make_client(max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)  # a long decode sends nothing for long
    return httpx.AsyncClient(limits=limits, timeout=timeout)


async def stream(client: httpx.AsyncClient, url: str, body: dict, sample: object, submission: int, chunks) -> None:
    """One request's chunks into `chunks` (a `queue.Queue`), then an end marker (or an error)."""
    finish = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                chunks.put(Chunk(sample, submission, [], [], error=f"HTTP {response.status_code}: {text}"))
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    chunks.put(Chunk(sample, submission, [], [], error=str(data["error"])[:500]))
                    return
                choice = data["choices"][0]
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
                finish = choice.get("finish_reason") or finish
                chunks.put(Chunk(sample, submission, choice.get("token_ids") or [], logprobs, finish))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine raises it in step(), with the sample's key
        chunks.put(Chunk(sample, submission, [], [], error=f"{type(exc).__name__}: {exc}"))
        return
    chunks.put(Chunk(sample, submission, [], [], finish, end=True))
