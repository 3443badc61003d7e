"""The judge client against a real local HTTP server that misbehaves on purpose (real sockets):
5xx and 429 are retried with backoff, timeouts and dropped connections too, 4xx and malformed
bodies give up at once, concurrency is bounded; every failure ends as a reply with an error."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gapless.envs.judge.client import HttpJudgeClient


class Misbehaving(BaseHTTPRequestHandler):
    """The first path segment picks the misbehaviour; counters are per (mode, prompt)."""

    protocol_version = "HTTP/1.1"
    calls: dict = {}
    in_flight = 0
    max_in_flight = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.path.split("/")[1]
        prompt = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
        with self.lock:
            n = self.calls[(mode, prompt)] = self.calls.get((mode, prompt), 0) + 1
            Misbehaving.in_flight += mode == "busy"  # earlier tests' slow handlers may still run
            Misbehaving.max_in_flight = max(Misbehaving.max_in_flight, Misbehaving.in_flight)
        try:
            self.respond(mode, n, prompt, body)
        finally:
            with self.lock:
                Misbehaving.in_flight -= mode == "busy"

    def respond(self, mode, n, prompt, body):
        if mode == "flaky" and n <= 2:
            return self.send(500, b"overloaded")
        if mode == "ratelimit" and n == 1:
            return self.send(429, b"slow down")
        if mode == "slow":
            time.sleep(1.0)
        if mode == "hangup":
            self.close_connection = True
            return self.connection.shutdown(2)  # no status line at all
        if mode == "bad":
            return self.send(400, b'{"error": {"message": "unknown model"}}')
        if mode == "garbage":
            return self.send(200, b"<html>not json</html>")
        if mode == "busy":
            time.sleep(0.1)
        text = f"Score: {len(prompt) % 10}"
        choice = {"message": {"role": "assistant", "content": text}} if "messages" in body else {"text": text}
        self.send(200, json.dumps({"choices": [choice]}).encode())

    def send(self, code, data):
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def client(server, mode, **kw):
    options = dict(timeout_s=0.3, max_retries=3, backoff_s=0.01, max_backoff_s=0.05)
    return HttpJudgeClient(f"{server}/{mode}/v1", **{**options, **kw})


def test_5xx_is_retried_until_it_succeeds(server):
    (reply,) = client(server, "flaky").judge(["abc"])
    assert reply.text == "Score: 3" and reply.error is None and reply.attempts == 3


def test_429_is_retried_and_chat_api_works(server):
    (reply,) = client(server, "ratelimit", api="chat").judge(["abcd"])
    assert reply.text == "Score: 4" and reply.attempts == 2


def test_5xx_beyond_the_retries_is_an_error_with_a_message(server):
    (reply,) = client(server, "flaky", max_retries=1).judge(["xyz"])
    assert reply.text is None and reply.attempts == 2
    assert "HTTP 500" in reply.error and "judge.base_url" in reply.error


def test_a_slow_server_times_out_within_the_bound(server):
    started = time.monotonic()
    (reply,) = client(server, "slow", max_retries=1).judge(["p"])
    elapsed = time.monotonic() - started
    assert reply.text is None and reply.attempts == 2 and "timed out" in reply.error
    assert elapsed < 2 * 1.0  # cut by the 0.3 s timeouts: waiting the server out would take 2 x 1 s


def test_a_dropped_connection_is_retried_then_reported(server):
    (reply,) = client(server, "hangup", max_retries=2).judge(["p"])
    assert reply.text is None and reply.attempts == 3 and reply.error


@pytest.mark.parametrize("mode, fragment", [("bad", "HTTP 400"), ("garbage", "not an OpenAI-style")])
def test_client_errors_and_malformed_bodies_are_not_retried(server, mode, fragment):
    (reply,) = client(server, mode).judge([f"{mode}-prompt"])
    assert reply.text is None and reply.attempts == 1 and fragment in reply.error
    assert Misbehaving.calls[(mode, f"{mode}-prompt")] == 1


def test_concurrency_is_bounded_and_order_kept(server):
    Misbehaving.max_in_flight = 0
    prompts = ["x" * i for i in range(12)]
    replies = client(server, "busy", concurrency=3).judge(prompts)
    assert [r.text for r in replies] == [f"Score: {i % 10}" for i in range(12)]
    assert Misbehaving.max_in_flight <= 3


def test_backoff_is_exponential_capped_and_jittered():
    c = HttpJudgeClient("http://127.0.0.1:9/v1", backoff_s=0.5, max_backoff_s=4.0)
    for retry, base in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)]:
        delays = [c.backoff_delay_s(retry) for _ in range(50)]
        assert all(base / 2 <= d <= base for d in delays) and len(set(delays)) > 1
