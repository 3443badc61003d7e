"""A small OpenAI-compatible HTTP server over gapless's own generator (`gapless serve`).

Endpoints (JSON in, JSON out, the subset that judges and eval harnesses use):
    GET  /v1/models             the one model served
    POST /v1/completions        prompt (string or list of strings), max_tokens, temperature
                                (0 = greedy), top_p, n, seed, stop, logprobs (any int: the
                                sampled tokens' log-probs; top alternatives are not returned)
    POST /v1/chat/completions   messages [{role, content}], rendered as "role: content" lines
                                plus "assistant:" (the tiny tokenizer has no chat template),
                                the same sampling fields, logprobs (bool)
Requests are served by a ThreadingHTTPServer; generation itself is serialised by one lock (the
sampler and its model are not thread-safe), so concurrent requests queue, they do not fail.
A bad request is HTTP 400 with {"error": {"message", "type"}} naming the field.

Guaranteed: a response's text, tokens and log-probs come from one `TorchSampler.generate`
call; the same request with the same seed gives the same answer. Not guaranteed: throughput
(no batching across requests), OpenAI fields beyond those listed (they are ignored), or
any authentication -- bind it to 127.0.0.1 (the default) unless the network is trusted.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gapless.generate.sampler import TorchSampler
from gapless.models import Policy
from gapless.types import Completion, SamplingParams

MAX_BODY_BYTES = 1 << 20


class BadRequest(ValueError):
    pass


class CompletionServer:
    """Serve `policy` at http://host:port/v1 (port 0 picks a free one; `url` says which)."""

    def __init__(self, policy: Policy, model_name: str = "gapless", host: str = "127.0.0.1", port: int = 0,
                 max_tokens_cap: int = 1024):
        self.policy = policy
        self.model_name = model_name
        self.max_tokens_cap = max_tokens_cap
        self.sampler = TorchSampler(policy.model, policy.eos_id, policy.pad_id, policy.decode)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> CompletionServer:
        """Serve from a background thread (tests, in-process judges)."""
        self._thread = threading.Thread(target=self.serve_forever, name="openai-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown() if self._thread is not None else None
        self.httpd.server_close()

    def complete(self, body: dict, chat: bool) -> dict:
        prompts = [_render_chat(body.get("messages"))] if chat else _prompts(body.get("prompt"))
        params = self._params(body)
        n = _int(body, "n", 1, 1, 16)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise BadRequest("stop must be a string or a list of strings")
        ids = [self.policy.encode(p) for p in prompts for _ in range(n)]
        with self._lock:
            completions = self.sampler.generate(ids, params)
        want_logprobs = bool(body.get("logprobs")) or body.get("logprobs") == 0
        choices = [self._choice(i, c, stop, chat, want_logprobs) for i, c in enumerate(completions)]
        prompt_tokens = sum(len(x) for x in ids)
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def _params(self, body: dict) -> SamplingParams:
        temperature = _number(body, "temperature", 1.0, 0.0, 10.0)
        return SamplingParams(temperature=temperature or 1.0, top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
                              max_new_tokens=_int(body, "max_tokens", 16, 1, self.max_tokens_cap),
                              greedy=temperature == 0.0, seed=_int(body, "seed", next(self._ids), 0, 2**63 - 1))

    def _choice(self, index: int, c: Completion, stop: list[str], chat: bool, want_logprobs: bool) -> dict:
        own = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids  # without the EOS
        text, finish = c.text, c.finish_reason
        cuts = [text.find(s) for s in stop if s and s in text]
        if cuts:
            text, finish = text[: min(cuts)], "stop"
        choice: dict = {"index": index, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if want_logprobs:
            tokens = [self.policy.decode([t]) for t in own]
            logprobs = c.logprobs[: len(own)]
            choice["logprobs"] = ({"content": [{"token": t, "logprob": lp} for t, lp in zip(tokens, logprobs)]} if chat
                                  else {"tokens": tokens, "token_logprobs": logprobs})
        return choice


def _handler(server: CompletionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
            else:
                self._send(404, _error(f"no route {self.path}"))

        def do_POST(self) -> None:  # noqa: N802
            routes = {"/v1/completions": False, "/v1/chat/completions": True}
            if self.path.rstrip("/") not in routes:
                self._send(404, _error(f"no route {self.path}"))
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY_BYTES:
                    raise BadRequest(f"Content-Length must be 1..{MAX_BODY_BYTES}")
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                self._send(200, server.complete(body, routes[self.path.rstrip("/")]))
            except (BadRequest, ValueError) as exc:
                self._send(400, _error(str(exc)))

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            pass  # one line per request would drown a training log

    return Handler


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _prompts(prompt) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    raise BadRequest("prompt must be a string or a non-empty list of strings")


def _render_chat(messages) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest("each message needs a string role and a string content")
        lines.append(f"{m['role']}: {m['content']}\n")
    return "".join(lines) + "assistant:"


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number in [{low}, {high}] (got {value!r})")
    return float(value)


def _int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}] (got {value!r})")
    return value


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None, log=print) -> None:
    """Load a local checkpoint and serve it until interrupted (the `gapless serve` command)."""
    from gapless.models import load_local

    server = CompletionServer(load_local(model_path), model_name or model_path, host, port)
    log(f"serving {model_path} at {server.url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
