"""A judge model on loopback for the tests: a threaded HTTP server whose every POST is answered by
a plain function of the decoded JSON body, so a test states only its judge's rule.

    with serving(lambda body: completion_reply(f"Score: {len(body['prompt']) % 11}")) as url:
        client = HttpJudgeClient(url, ...)        # url is "http://127.0.0.1:PORT/v1"

A rule returns a `Reply` (status and body bytes); `completion_reply` and `chat_reply` build the
OpenAI shapes the judge clients read. A body that is not JSON reaches the rule as None.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes


def completion_reply(text: str) -> Reply:
    return Reply(200, json.dumps({"choices": [{"text": text}]}).encode())


def chat_reply(model: str, text: str) -> Reply:
    message = {"role": "assistant", "content": text}
    return Reply(
        200,
        json.dumps(
            {
                "id": "j",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode(),
    )


@contextmanager
def serving(rule: Callable[[Any], Reply]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                body = json.loads(raw.decode("utf-8", "strict"))
            except ValueError:
                body = None
            reply = rule(body)
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
