"""The training gateway: an OpenAI-compatible endpoint per episode, answered by the run's sampler.

    agent process ──POST {base}/episodes/KEY/v1/chat/completions──> Gateway (uvicorn thread)
                                                                      │ Channel(KEY).calls
    AgentEnvironment (envs/agent/environment.py), the episode's thread  <─────────┘ next(): a Call, or Exited
        renders the call (serve/transcript.py), has the turn sampled, answer(call, reply) ──> 200

Each episode gets its own channel with an unguessable key in its base URL, so an agent reaches
only its own episode. A call blocks the agent until the episode's environment answers it (the
turn sampled by the generator, possibly in another process) or refuses it (400 with an OpenAI
error body; the reason in `code`). The reply is a `chat.completion` whose `gapless` field carries
the sampled `token_ids`, their `logprobs` and policy `versions` (token in, token out; clients
ignore unknown fields). Sampling is the run's: the request's sampling fields (temperature,
max_tokens, seed, ...) are accepted and ignored, so the trained tokens follow the run's sampler;
`n` must be 1 and `stream` false (a 400 otherwise).

Tool calling: a call's `tools`, assistant `tool_calls` and `tool` messages are rendered as plain
messages in the Hermes-like tool-call format (serve/tools/render.py), and a reply to a call that
offered tools is parsed into `tool_calls` (finish reason 'tool_calls'). An assistant message whose
calls this channel issued is rendered as the exact text that was sampled (not re-serialised from
its parsed calls), so the next call extends the transcript with the sampled tokens as they are.
`tool_choice` required / named and structured outputs are refused (400): they need constrained
decoding, and the run's sampler samples the policy unconstrained -- the tokens trained on are
what the policy chose.

Guaranteed: one call per channel is open at a time (a second, concurrent call is a 409); a closed
channel answers 410 and fails the call it holds; `close()` stops the server. Every text crosses
as valid Unicode (`unicode_text`): a lone surrogate in a sampled reply or in an agent's message
(JSON may escape one) is replaced by '?', so neither the reply's encoding (a 500) nor the
tokenizer (which refuses one) can fail on the model's bytes; a non-finite log-prob crosses as
null (JSON has no NaN). Not guaranteed:
transport security (it listens on 127.0.0.1 only; the key is a capability, not encryption).
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gapless.serve.openai.params import ChatBody, parse_body
from gapless.serve.protocol import ServeError
from gapless.serve.tools.parsers import HERMES
from gapless.serve.tools.render import plain_messages
from gapless.serve.tools.reply import tool_message
from gapless.text import unicode_text


@dataclass
class Call:
    """One chat call waiting for its answer."""

    messages: list[tuple[str, str]]
    _loop: asyncio.AbstractEventLoop
    _future: asyncio.Future
    number: int = 0  # calls made on the channel before this one
    tools: list[dict] = field(default_factory=list)  # the function tools offered (replies are parsed for calls)


@dataclass(frozen=True)
class Exited:
    """The agent process ended (put by its watcher)."""

    returncode: int


@dataclass
class Channel:
    key: str
    model: str
    events: queue.Queue = field(default_factory=queue.Queue)  # Call or Exited, in order
    open_call: Call | None = None
    closed: bool = False
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    sampled: dict[str, str] = field(default_factory=dict)  # tool call id -> the reply text it was parsed from

    # ---- the environment's side ------------------------------------------------------------
    def next(self, timeout: float) -> Call | Exited | None:
        """The next call or the agent's exit; None when `timeout` passes first."""
        try:
            return self.events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def answer(
        self,
        call: Call,
        text: str,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        finish_reason: str,
        prompt_tokens: int,
    ) -> None:
        logprobs = [x if math.isfinite(x) else None for x in logprobs]
        text = unicode_text(text)
        message, finish = {"role": "assistant", "content": text}, "length" if finish_reason == "length" else "stop"
        if call.tools:
            message, finish = tool_message(text, finish, HERMES)
            self.sampled.update((c["id"], text) for c in message.get("tool_calls", []))
        body = {
            "id": f"chatcmpl-{self.key[:12]}-{call.number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(token_ids),
                "total_tokens": prompt_tokens + len(token_ids),
            },
            "gapless": {"token_ids": token_ids, "logprobs": logprobs, "versions": versions},
        }
        self._settle(call, 200, body)

    def refuse(self, call: Call, message: str, code: str, status: int = 400) -> None:
        self._settle(call, status, _error_body(message, code))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            call, self.open_call = self.open_call, None
        if call is not None:
            self._settle(call, 410, _error_body("the episode is over", "episode_over"))

    def _settle(self, call: Call, status: int, body: dict) -> None:
        with self.lock:
            if self.open_call is call:
                self.open_call = None

        def settle() -> None:
            if not call._future.done():
                call._future.set_result((status, body))

        call._loop.call_soon_threadsafe(settle)

    # ---- the HTTP side -----------------------------------------------------------------------
    def plain(self, body: ChatBody) -> list[tuple[str, str]]:
        """The call's messages as (role, content) pairs; this channel's own tool-calling replies as sampled."""
        dicts = []
        for m in body.messages:
            raw = self.sampled.get(m.tool_calls[0].id) if m.tool_calls else None
            dicts.append({"role": "assistant", "content": raw} if raw is not None else m.as_dict())
        return plain_messages(dicts, body.tool_dicts, HERMES)

    async def call(self, messages: list[tuple[str, str]], tools: list[dict] | None = None) -> tuple[int, dict]:
        loop = asyncio.get_running_loop()
        with self.lock:
            if self.closed:
                return 410, _error_body("the episode is over", "episode_over")
            if self.open_call is not None:
                return 409, _error_body("another call of this episode is waiting for its answer", "call_in_progress")
            call = Call(messages, loop, loop.create_future(), self.calls, list(tools or []))
            self.open_call, self.calls = call, self.calls + 1
        self.events.put(call)
        return await call._future


class Gateway:
    """The per-episode endpoints of one environment, served from a background thread."""

    def __init__(self, model: str = "gapless-policy", host: str = "127.0.0.1"):
        from gapless.serve.openai.server import ServerThread  # uvicorn, on a socket bound now

        self.model = model
        self.channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        routes = [
            Route("/episodes/{key}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/episodes/{key}/v1/models", self._models, methods=["GET"]),
        ]
        self.server = ServerThread(Starlette(routes=routes), host=host, port=0)
        self.root = self.server.url.removesuffix("/v1")

    def open(self) -> tuple[Channel, str]:
        """A new episode's channel and the base URL its agent uses (OPENAI_BASE_URL)."""
        key = secrets.token_urlsafe(16)
        channel = Channel(key, self.model)
        with self._lock:
            self.channels[key] = channel
        return channel, f"{self.root}/episodes/{key}/v1"

    def forget(self, channel: Channel) -> None:
        channel.close()
        with self._lock:
            self.channels.pop(channel.key, None)

    def close(self) -> None:
        for channel in list(self.channels.values()):
            self.forget(channel)
        self.server.close(scheduler=False)

    async def _models(self, request: Request) -> Response:
        if self.channels.get(request.path_params["key"]) is None:
            return JSONResponse(_error_body("no such episode", "episode_unknown"), status_code=404)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "gapless"}]})

    async def _chat(self, request: Request) -> Response:
        channel = self.channels.get(request.path_params["key"])
        if channel is None:
            return JSONResponse(_error_body("no such episode", "episode_unknown"), status_code=404)
        try:
            body = parse_body(ChatBody, json.loads(await request.body() or b"null"))
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser's depth
            return JSONResponse(
                _error_body(f"the body is not JSON: {type(exc).__name__}: {str(exc)[:200]}", "invalid_json"),
                status_code=400,
            )
        except ServeError as exc:
            return JSONResponse(_error_body(str(exc), exc.code or "invalid_request", exc.param), status_code=exc.status)
        if body.n != 1 or body.stream:
            return JSONResponse(
                _error_body(
                    "the training gateway answers one sample per call, without streaming (n = 1, stream = false)",
                    "unsupported",
                ),
                status_code=400,
            )
        if body.forced_tools is not None or body.structure_spec() is not None:
            return JSONResponse(
                _error_body(
                    "tool_choice required / named and structured outputs need constrained decoding; "
                    "the training gateway samples the policy unconstrained: use tool_choice auto "
                    "and no response_format",
                    "unsupported",
                ),
                status_code=400,
            )
        messages = [(role, unicode_text(text)) for role, text in channel.plain(body)]
        status, payload = await channel.call(messages, body.tool_dicts)
        return JSONResponse(payload, status_code=status)


def _error_body(message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
