"""Clients that ask a judge model for verdicts: an OpenAI-compatible HTTP endpoint, or a local model.

    JudgeClient.judge(prompts) -> [JudgeReply]     one reply per prompt, in order, never raising

HttpJudgeClient speaks `/v1/completions` (api = "completions": the rubric prompt is sent as is)
or `/v1/chat/completions` (api = "chat": the prompt is one user message), as vLLM, SGLang and
`gapless serve` serve them, with the stdlib only (urllib). Who waits for whom:

    judge(prompts) ──> thread pool (`concurrency` requests in flight at most)
                          each: POST, timeout_s per attempt
                                connection error / timeout / 5xx / 429 -> sleep backoff, retry
                                other 4xx or a malformed body          -> give up at once
                                (a retry cannot fix our request or their protocol)
                <── replies in prompt order; a request that never succeeded is JudgeReply(error=...)

Backoff before retry k (k = 1, 2, ...): min(max_backoff_s, backoff_s * 2**(k-1)) * U(0.5, 1)
("equal jitter", so a fleet of workers that failed together does not retry together).
Guaranteed: `judge` returns within roughly (max_retries + 1) * timeout_s + the backoffs per
request batch of `concurrency`; every failure is a reply with `error` set, whose text says what
to check. Not guaranteed: that the endpoint's sampling is deterministic.

SchedulerJudgeClient submits each prompt to a serving `Scheduler` in-process (gapless.serve):
the same scheduler `gapless serve` puts behind HTTP, so judge requests share engine steps with
whatever else it serves, and the prompt is built as the server's routes build it (completions:
the rubric's tokens; chat: the judge tokenizer's chat template). A full scheduler is waited out,
a refused prompt (beyond the judge's context) is a reply with an error.
LocalJudgeClient runs any `generate(prompt_ids, params)` generator in-process (the reference
sampler in tests); it never fails for network reasons, and its replies cost generator time here.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Protocol, Sequence

from gapless.types import SamplingParams

RETRY_HTTP_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass
class JudgeReply:
    text: str | None  # the judge's verdict; None when no request succeeded
    error: str | None = None  # why there is no verdict (after every retry)
    attempts: int = 1
    latency_s: float = 0.0


class JudgeClient(Protocol):
    def judge(self, prompts: Sequence[str]) -> list[JudgeReply]: ...

    def close(self) -> None: ...


class _GiveUp(Exception):
    """A failure that a retry cannot fix (4xx other than 429, malformed body)."""


class HttpJudgeClient:
    def __init__(
        self,
        base_url: str,
        model: str = "judge",
        api: Literal["completions", "chat"] = "completions",
        max_tokens: int = 16,
        temperature: float = 0.0,
        timeout_s: float = 30.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        concurrency: int = 8,
        seed: int = 0,
    ):
        self.url = base_url.rstrip("/") + ("/chat/completions" if api == "chat" else "/completions")
        self.model, self.api = model, api
        self.max_tokens, self.temperature = max_tokens, temperature
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="judge")

    def judge(self, prompts: Sequence[str]) -> list[JudgeReply]:
        return list(self._pool.map(self.ask, prompts))

    def ask(self, prompt: str) -> JudgeReply:
        started, last_error = time.monotonic(), ""
        for attempt in range(1, self.max_retries + 2):
            if attempt > 1:
                time.sleep(self.backoff_delay_s(attempt - 1))
            try:
                return JudgeReply(self._post(prompt), attempts=attempt, latency_s=time.monotonic() - started)
            except _GiveUp as exc:
                last_error = str(exc)
                break
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # 429/5xx, resets, timeouts
                last_error = _describe(exc)
        return JudgeReply(
            None,
            f"judge at {self.url} failed after {attempt} attempt(s): {last_error}; check that the "
            f"server is up and judge.base_url / judge.api are right",
            attempt,
            time.monotonic() - started,
        )

    def backoff_delay_s(self, retry: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1)) * self._rng.uniform(0.5, 1.0)

    def _post(self, prompt: str) -> str:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        request = urllib.request.Request(self.url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code in RETRY_HTTP_STATUSES:
                raise
            raise _GiveUp(f"HTTP {exc.code}: {exc.read()[:200]!r}") from None
        return self._verdict(raw)

    def _verdict(self, raw: bytes) -> str:
        try:
            choice = json.loads(raw)["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _GiveUp(f"not an OpenAI-style {self.api} response: {raw[:200]!r}") from None
        if not isinstance(text, str):
            raise _GiveUp(f"the response's text is not a string: {raw[:200]!r}")
        return text

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    reason = getattr(exc, "reason", None)
    return f"{type(exc).__name__}: {reason if reason is not None else exc}"


class LocalJudgeClient:
    """A judge on gapless's own generator (any object with `generate(prompt_ids, params)`)."""

    def __init__(self, generator, encode, max_new_tokens: int = 16, temperature: float = 0.0, batch_size: int = 64):
        self.generator, self.encode = generator, encode
        self.params = SamplingParams(
            temperature=temperature or 1.0, max_new_tokens=max_new_tokens, greedy=temperature == 0.0
        )
        self.batch_size = batch_size

    def judge(self, prompts: Sequence[str]) -> list[JudgeReply]:
        replies = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = [self.encode(p) for p in prompts[start : start + self.batch_size]]
            replies += [JudgeReply(c.text) for c in self.generator.generate(chunk, self.params)]
        return replies

    def close(self) -> None:
        pass


class SchedulerJudgeClient:
    """Judge requests on a gapless serving `Scheduler` (source "judge"); `owns` closes it on close()."""

    def __init__(
        self,
        scheduler,
        encode: Callable[[str], list[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        owns: bool = False,
    ):
        self.scheduler, self.encode, self.owns = scheduler, encode, owns
        self.params = SamplingParams(
            temperature=temperature or 1.0, max_new_tokens=max_tokens, greedy=temperature == 0.0, seed=seed
        )

    def judge(self, prompts: Sequence[str]) -> list[JudgeReply]:
        from gapless.serve.protocol import QueueFull, SampleRequest, ServeError

        started, handles = time.monotonic(), []
        for prompt in prompts:
            request = SampleRequest(tuple(self.encode(prompt)), self.params, source="judge")
            while True:
                try:
                    handles.append(self.scheduler.submit(request))
                    break
                except QueueFull:  # wait for our oldest unfinished request, then try again
                    pending = [h for h in handles if not isinstance(h, str) and not h.done]
                    pending[0].result() if pending else time.sleep(0.05)
                except ServeError as exc:
                    handles.append(f"the judge refused the prompt: {exc.message}")
                    break
        return [
            JudgeReply(None, h)
            if isinstance(h, str)
            else JudgeReply(h.result()[0].text, latency_s=time.monotonic() - started)
            for h in handles
        ]

    def close(self) -> None:
        if self.owns:
            self.scheduler.close()
