"""The routes vLLM serves beside the OpenAI API: tokenizer access and Prometheus metrics.

    POST /tokenize     {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"tokens": [int]}                      -> {"prompt": str}
    GET  /metrics      Prometheus text exposition (prometheus_client), read from the scheduler at scrape time

Bodies and answers follow vLLM's field names, so clients written for vLLM (lm-eval's remote
tokenizer probe, dashboards) read them. `/tokenize` of messages renders the chat template exactly
as /v1/chat/completions does (chat.py), so its count is that route's prompt_tokens.
Each app has its own registry: two servers in one process never share or clash on a metric.
Not guaranteed: vLLM's metric names (they are `gapless_*`), latency histograms.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import Field
from starlette.responses import Response

from gapless.serve.openai.chat import chat_prompt_ids
from gapless.serve.openai.params import Message, _Body
from gapless.serve.protocol import InvalidRequest
from gapless.serve.scheduler import Scheduler


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def tokenize(tokenizer, body: TokenizeBody, max_model_len: int) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send exactly one of prompt (text) or messages (a chat)", "prompt")
    if body.messages is not None:
        ids = chat_prompt_ids(tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids), "token_strs": strs}


def detokenize(tokenizer, body: DetokenizeBody, vocab_size: int) -> dict:
    if bad := [t for t in body.tokens if not 0 <= t < vocab_size]:
        raise InvalidRequest(f"tokens: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


class _SchedulerCollector:
    """Reads the scheduler's counters when Prometheus scrapes (nothing to update on the hot path)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        s, stats = self.scheduler, self.scheduler.stats
        gauges = {
            "requests_running": ("requests the scheduler tracks (running or waiting)", s.num_handles),
            "samples_in_flight": ("samples running or waiting in the engine", s.samples_in_flight),
            "policy_version": ("version of the weights that sample new tokens", s.version),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"gapless_{name}", doc, value=value)
        counters = {
            "requests_submitted": ("requests accepted by the scheduler", stats.submitted),
            "requests_rejected": ("requests refused by a full queue (HTTP 429)", stats.rejected),
            "samples_aborted": ("samples aborted (client gone, stop string, shutdown)", stats.aborted_samples),
            "samples_finished": ("samples finished", stats.finished_samples),
            "engine_steps": ("engine steps with work", stats.steps),
            "generation_tokens": ("completion tokens generated", stats.tokens),
        }
        if (cache := getattr(getattr(s.engine, "stats", None), "prefix_cache", None)) is not None:
            counters |= {
                "prefix_cache_hits": ("prompts that reused cached keys/values", cache.hits),
                "prefix_cache_misses": ("prompts with no cached prefix", cache.misses),
                "prefix_cache_hit_tokens": ("prompt tokens whose keys/values came from the cache", cache.hit_tokens),
            }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"gapless_{name}", doc, value=value)


class PrometheusMetrics:
    def __init__(self, scheduler: Scheduler):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler))

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
