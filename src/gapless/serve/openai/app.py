"""The OpenAI-compatible HTTP API as an ASGI app (Starlette) over one `Scheduler`.

    GET  /v1/models, /v1/models/{id}    the one served model (another id is a 404)
    POST /v1/completions                 prompt: string, strings, token ids or lists of token ids
    POST /v1/chat/completions            messages rendered by the tokenizer's chat template (chat.py)
    POST /v1/responses                   the Responses API over the chat path (responses.py)
    POST /tokenize, /detokenize          vLLM's tokenizer routes (openai/extras.py)
    GET  /health, /metrics               liveness; the scheduler's counters in Prometheus text

Each route parses the body itself (strict models in openai/params.py, so every failure, malformed
JSON included, is an OpenAI-shaped 400 naming the field), turns it into `SampleRequest`s and awaits
their handles. Streams are server-sent events: a chunk per sample per engine step, a `usage`
chunk before `data: [DONE]` when `stream_options.include_usage` asks for it (deltas that piled up
while the loop was busy go out merged, one chunk per sample), an error after the
headers as a `data: {"error": ...}` event. Who cancels what: a stream's generator aborts its
handles in `finally` (Starlette cancels it when the client goes); a non-streaming route races
its results against the client's `http.disconnect` and aborts on whichever comes first.

Errors are `{"error": {"message", "type", "param", "code"}}` with 400 (bad request, prompt beyond
the context: code `context_length_exceeded`), 401 (`--api-key` set, wrong or no bearer token),
404 (unknown model or route), 413 (body over `max_body_bytes`), 429 (scheduler full, with
Retry-After), 500 (anything else; the server lives on).
Structured outputs (response_format, vLLM's structured_outputs / guided_*) and tool_choice
required / named are served by grammar-constrained decoding (grammar.py, tools/choice.py); with
tools offered, replies are parsed into `tool_calls` by the server's tool-call format (tools/).
Log-prob lists hold every sampled token, a final EOS or stop token included (spelled as its
special-token text, as OpenAI and vLLM list it), though the `text` leaves it out.
Not guaranteed: images, `best_of` ranking, top alternatives on streams.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gapless.serve.grammar import Grammars, StructureSpec
from gapless.serve.openai.chat import chat_prompt_ids
from gapless.serve.openai.extras import DetokenizeBody, PrometheusMetrics, TokenizeBody, detokenize, tokenize
from gapless.serve.openai.params import ChatBody, CompletionBody, parse_body
from gapless.serve.openai.responses import ResponsesBody
from gapless.serve.openai.responses_output import output_items, response_events, response_object
from gapless.serve.protocol import (
    ContextLengthExceeded,
    InvalidRequest,
    SampleRequest,
    SampleResult,
    ServeError,
    merge_deltas,
)
from gapless.serve.scheduler import RequestHandle, Scheduler
from gapless.serve.scoring import Scorer
from gapless.serve.tools.choice import forced_calls
from gapless.serve.tools.parsers import tool_call_format
from gapless.serve.tools.reply import ToolStream, tool_message

log = logging.getLogger("gapless.serve")


class NotFound(ServeError):
    status, code = 404, "model_not_found"


class BodyTooLarge(ServeError):
    status, code = 413, "body_too_large"


class Unauthorized(ServeError):
    status, code = 401, "invalid_api_key"


class ClientGone(Exception):
    """The client disconnected before its result was ready."""


class OpenAIApp:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        model_name: str,
        *,
        scorer: Scorer | None = None,
        api_key: str | None = None,
        max_body_bytes: int = 16 << 20,
        default_max_tokens: int = 1024,
        tool_call_parser: str = "hermes",
    ):
        self.scheduler, self.tokenizer, self.model_name = scheduler, tokenizer, model_name
        self.tool_format = tool_call_format(tool_call_parser)
        self._grammars: Grammars | None = None  # built on the first constrained request
        self.scorer, self.api_key = scorer, api_key
        self.max_body_bytes, self.default_max_tokens = max_body_bytes, default_max_tokens
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self._max_token_chars = max(1, max(map(len, tokenizer.get_vocab())))
        self._created = int(time.time())
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", lambda request: JSONResponse({"status": "ok"}), methods=["GET"]),
            Route("/metrics", lambda request: self._prometheus.response(), methods=["GET"]),
        ]
        self._prometheus = PrometheusMetrics(scheduler)
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.api_key is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}"):
                response = _error(Unauthorized("invalid or missing API key: send Authorization: Bearer <key>"))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

    # ---- routes ---------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model_id"] != self.model_name:
            return _error(
                NotFound(
                    f"the model {request.path_params['model_id']!r} does not exist; this server serves "
                    f"{self.model_name!r}",
                    "model",
                )
            )
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        try:
            body = parse_body(TokenizeBody, await self._json(request))
            self._check_model(body.model)
            return JSONResponse(tokenize(self.tokenizer, body, self.scheduler.max_seq_len))
        except ServeError as exc:
            return _error(exc)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = parse_body(DetokenizeBody, await self._json(request))
            self._check_model(body.model)
            return JSONResponse(detokenize(self.tokenizer, body, self.vocab_size))
        except ServeError as exc:
            return _error(exc)

    async def responses(self, request: Request) -> Response:
        try:
            body = parse_body(ResponsesBody, await self._json(request))
            self._check_model(body.model)
            chat = body.chat_body()
            prompt, max_new, constraint = await self._chat_plan(chat)
            sampling = chat.sampling(max_new, self.vocab_size)
            handle = self.scheduler.submit(
                SampleRequest(tuple(prompt), sampling, 1, tuple(chat.stop or ()), "http", body.stream, constraint)
            )
            fmt = self.tool_format if chat.tool_dicts else None
            if body.stream:
                return StreamingResponse(
                    response_events(body, self.model_name, handle, fmt),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            [result] = (await _results_unless_gone(request, [handle]))[0]
            rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
            output = output_items(result, fmt)
            return JSONResponse(response_object(body, self.model_name, rid, created, result, len(prompt), output))
        except ServeError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)

    async def completions(self, request: Request) -> Response:
        try:
            body = parse_body(CompletionBody, await self._json(request))
            self._check_model(body.model)
            prompts = await self._completion_prompts(body.prompt, body.max_tokens or 0)
            if body.max_tokens == 0:  # echo-only scoring of the prompts
                for p in prompts:
                    if not 0 < len(p) <= self.scheduler.max_seq_len:
                        raise ContextLengthExceeded(
                            f"a prompt to score needs 1..{self.scheduler.max_seq_len} tokens (got {len(p)})", "prompt"
                        )
                results = [[SampleResult(j, p, finish_reason="length") for j in range(body.n)] for p in prompts]
            else:
                constraint = await self._constraint(body.structure_spec())
                results = await self._run(
                    request, body, [tuple(p) for p in prompts], body.max_tokens or 16, chat=False, constraint=constraint
                )
                if isinstance(results, Response):
                    return results
            choices = [
                await self._completion_choice(i * body.n + r.index, r, body) for i, rs in enumerate(results) for r in rs
            ]
            return JSONResponse(self._envelope("text_completion", "cmpl", choices, prompts, results))
        except ServeError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)

    async def chat(self, request: Request) -> Response:
        try:
            body = parse_body(ChatBody, await self._json(request))
            self._check_model(body.model)
            prompt, max_new, constraint = await self._chat_plan(body)
            results = await self._run(request, body, [tuple(prompt)], max_new, chat=True, constraint=constraint)
            if isinstance(results, Response):
                return results
            choices = [await self._chat_choice(r, body) for r in results[0]]
            return JSONResponse(self._envelope("chat.completion", "chatcmpl", choices, [prompt], results))
        except ServeError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)

    async def _chat_plan(self, body: ChatBody) -> tuple[list[int], int, object]:
        """A chat body's prompt ids, its max new tokens, and the grammar its reply must follow (or None):
        the tool-choice grammar when tools must be called, else the structured-output one."""
        self._check_length(sum(len(m.text) for m in body.messages), body.max_new_tokens or 1)
        tools = body.tool_dicts
        render = lambda: chat_prompt_ids(self.tokenizer, body.messages, tools, self.tool_format)  # noqa: E731
        prompt = await asyncio.to_thread(render) if sum(len(m.text) for m in body.messages) > 4096 else render()
        max_new = body.max_new_tokens or min(self.default_max_tokens, max(1, self.scheduler.max_seq_len - len(prompt)))
        forced = body.forced_tools
        spec = (
            body.structure_spec()
            if forced is None
            else forced_calls(
                forced,
                self.tool_format,
                parallel=body.parallel_tool_calls is not False and body.tool_choice == "required",
            )
        )
        return prompt, max_new, await self._constraint(spec)

    # ---- requests -------------------------------------------------------------------------
    async def _json(self, request: Request) -> object:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge(f"the body has {declared} bytes; the limit is {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge(f"the body is over the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError as exc:
            raise InvalidRequest(f"the body is not valid JSON: {exc}") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}", "model")

    def _check_length(self, chars: int, max_new_tokens: int) -> None:
        """Refuse a text that cannot fit before tokenizing it: it has at least chars / (longest
        token's length) tokens (a ~1 MB prompt is refused in milliseconds, not after tokenizing)."""
        at_least = math.ceil(chars / self._max_token_chars)
        if at_least + max_new_tokens > self.scheduler.max_seq_len:
            raise ContextLengthExceeded(
                f"this model's context is {self.scheduler.max_seq_len} tokens; the prompt has at least {at_least} and "
                f"max_tokens is {max_new_tokens}: shorten the prompt or lower max_tokens",
                "prompt",
            )

    async def _completion_prompts(self, prompt, max_new_tokens: int) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            for text in texts:
                self._check_length(len(text), max_new_tokens)
            encode = lambda: [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]  # noqa: E731
            return await asyncio.to_thread(encode) if sum(map(len, texts)) > 4096 else encode()
        ids = [prompt] if isinstance(prompt[0], int) else prompt
        for row in ids:
            if bad := [t for t in row if not 0 <= t < self.vocab_size]:
                raise InvalidRequest(
                    f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt"
                )
        return [list(row) for row in ids]

    async def _constraint(self, spec: StructureSpec | None):
        """The per-sample grammar factory of `spec` (compiled off the event loop, cached), or None."""
        if spec is None:
            return None
        if self._grammars is None:
            engine = self.scheduler.engine
            vocab = getattr(getattr(engine, "runner", None), "vocab_size", self.vocab_size)
            stops = {self.eos_id, *getattr(engine, "stop_ids", ())}
            self._grammars = await asyncio.to_thread(Grammars, self.tokenizer, vocab, stops)
        return (await asyncio.to_thread(self._grammars.compile, spec)).constraint

    async def _run(
        self, request: Request, body, prompts: list[tuple[int, ...]], max_new: int, chat: bool, constraint=None
    ):
        params = body.sampling(max_new, self.vocab_size)
        handles: list[RequestHandle] = []
        try:
            for prompt in prompts:
                handles.append(
                    self.scheduler.submit(
                        SampleRequest(prompt, params, body.n, tuple(body.stop or ()), "http", body.stream, constraint)
                    )
                )
        except ServeError:
            for handle in handles:
                handle.abort()
            raise
        if body.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._sse(handles, body, chat), media_type="text/event-stream", headers=headers)
        return await _results_unless_gone(request, handles)

    # ---- responses ------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "gapless",
            "max_model_len": self.scheduler.max_seq_len,
        }

    def _envelope(self, kind: str, prefix: str, choices: list[dict], prompts, results) -> dict:
        prompt_tokens = sum(map(len, prompts))
        completion_tokens = sum(len(r.token_ids) for rs in results for r in rs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    async def _completion_choice(self, index: int, r: SampleResult, body: CompletionBody) -> dict:
        prompt_text = self.tokenizer.decode(r.prompt_ids) if body.echo else ""
        choice = {"index": index, "text": prompt_text + r.text, "logprobs": None, "finish_reason": r.finish_reason}
        if body.logprobs is not None:
            own = r.token_ids  # EOS and stop tokens included, spelled as their special-token text (OpenAI, vLLM)
            ids, lps, tops = list(own), list(r.logprobs[: len(own)]), [[] for _ in own]
            if body.logprobs or body.echo:
                scored, scored_tops = await self._score(
                    r, own, body.logprobs, 1 if body.echo else len(r.prompt_ids), body.temperature
                )
                if body.echo:
                    ids = r.prompt_ids + ids
                    lps = [None] + scored[: len(r.prompt_ids) - 1] + lps
                    tops = [None] + scored_tops[: len(r.prompt_ids) - 1] + scored_tops[len(r.prompt_ids) - 1 :]
                else:
                    tops = scored_tops
            tokens = [self.tokenizer.decode([t]) for t in ids]
            offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": lps,
                "text_offset": offsets,
                "top_logprobs": None
                if not body.logprobs
                else [None if t is None else {self.tokenizer.decode([i]): v for i, v in t} for t in tops],
            }
        if body.return_token_ids:
            choice.update(_token_fields(r))
        return choice

    async def _chat_choice(self, r: SampleResult, body: ChatBody) -> dict:
        choice = {
            "index": r.index,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": None,
            "finish_reason": r.finish_reason,
        }
        if body.tool_dicts:
            choice["message"], choice["finish_reason"] = tool_message(r.text, r.finish_reason, self.tool_format)
        if body.logprobs:
            own = r.token_ids
            tops = [[] for _ in own]
            if body.top_logprobs:
                _, tops = await self._score(r, own, body.top_logprobs, len(r.prompt_ids), body.temperature)
            choice["logprobs"] = {
                "content": [self._chat_logprob(t, lp, top) for t, lp, top in zip(own, r.logprobs, tops)],
                "refusal": None,
            }
        if body.return_token_ids:
            choice.update(_token_fields(r))
        return choice

    def _chat_logprob(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        text = self.tokenizer.decode([token])
        return {
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (s := self.tokenizer.decode([i])), "logprob": v, "bytes": list(s.encode())} for i, v in top
            ],
        }

    async def _score(self, r: SampleResult, own: list[int], top: int, start: int, temperature: float | None):
        """Log-probs by a full forward pass (scoring.py), at the temperature the engine sampled with."""
        if self.scorer is None:
            raise InvalidRequest(
                "this server was started without a scorer: top alternatives and echo log-probs are off"
            )
        return await asyncio.to_thread(self.scorer.score, r.prompt_ids + own, start, temperature or 1.0, top)

    async def _sse(self, handles: list[RequestHandle], body, chat: bool) -> AsyncIterator[str]:
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": created, "model": self.model_name}
        if body.include_usage:
            head["usage"] = None
        offsets: dict[int, int] = {}
        tool_streams = {} if chat and body.tool_dicts else None  # choice index -> its ToolStream
        try:
            if chat:
                yield "".join(
                    _event(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": j,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                    for j in range(body.n)
                )
            for p, handle in enumerate(handles):
                async for batch in handle.adeltas():
                    events = []
                    for d in merge_deltas(batch):  # a loop that fell behind sends fewer, larger chunks
                        index, first = p * body.n + d.index, p * body.n + d.index not in offsets
                        text = (
                            self.tokenizer.decode(handle.request.prompt_ids) if first and not chat and body.echo else ""
                        ) + d.text
                        choice = {
                            "index": index,
                            "logprobs": self._stream_logprobs(d.token_ids, d.logprobs, body, chat, offsets, index),
                            "finish_reason": d.finish_reason,
                        }
                        choice.update({"delta": {"content": text}} if chat else {"text": text})
                        if tool_streams is not None:
                            stream = tool_streams.setdefault(index, ToolStream(self.tool_format))
                            choice["delta"], choice["finish_reason"] = stream.delta(text, d.finish_reason)
                        if body.return_token_ids:
                            choice.update(
                                {
                                    "token_ids": d.token_ids,
                                    "sampling_logprobs": d.logprobs,
                                    "policy_versions": d.versions,
                                }
                            )
                            if first:
                                choice["prompt_token_ids"] = list(handle.request.prompt_ids)
                        offsets.setdefault(index, 0)
                        events.append(_event({**head, "choices": [choice]}))
                    yield "".join(events)
            if body.include_usage:
                completion_tokens = sum(len(r.token_ids) for h in handles for r in h.results)
                usage = _usage(sum(len(h.request.prompt_ids) for h in handles), completion_tokens)
                yield _event({**head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        except ServeError as exc:
            yield _event(_error_body(exc))
        finally:
            for handle in handles:
                handle.abort()

    def _stream_logprobs(self, own: list[int], logprobs: list[float], body, chat: bool, offsets: dict, index: int):
        if (chat and not body.logprobs) or (not chat and body.logprobs is None):
            return None
        if chat:
            return {"content": [self._chat_logprob(t, lp, []) for t, lp in zip(own, logprobs)], "refusal": None}
        tokens = [self.tokenizer.decode([t]) for t in own]
        start = offsets.get(index, 0)
        text_offset = [start + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        offsets[index] = start + sum(map(len, tokens))
        return {
            "tokens": tokens,
            "token_logprobs": logprobs[: len(own)],
            "top_logprobs": None,
            "text_offset": text_offset,
        }


async def _results_unless_gone(request: Request, handles: list[RequestHandle]) -> list[list[SampleResult]]:
    """All handles' results, or ClientGone (and every handle aborted) if the client leaves first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    results = asyncio.ensure_future(asyncio.gather(*(h.aresult() for h in handles)))
    try:
        done, _ = await asyncio.wait({watcher, results}, return_when=asyncio.FIRST_COMPLETED)
        if results in done:
            return results.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not results.done():
            results.cancel()
        for handle in handles:
            handle.abort()


def _token_fields(r: SampleResult) -> dict:
    return {
        "prompt_token_ids": r.prompt_ids,
        "token_ids": r.token_ids,
        "sampling_logprobs": r.logprobs,
        "policy_versions": r.versions,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _error_body(exc: ServeError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def _error(exc: ServeError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(_error_body(exc), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    error = ServeError(f"{request.method} {request.url.path}: {exc.detail}")
    error.status, error.type = exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(error)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path)
    error = ServeError(f"internal server error: {type(exc).__name__}: {exc}")
    error.status, error.type = 500, "server_error"
    return _error(error)
