"""Serving a policy: one request scheduler per served model, shared by every client, and the
OpenAI-compatible HTTP API over it (`gapless serve`; docs/serving.md).

    protocol.py     typed records (SampleRequest, SampleDelta, SampleResult) and ServeErrors
    scheduler.py    the engine thread: requests in, per-step deltas out, abort, admission
    detokenize.py   incremental text, stop strings
    scoring.py      extra log-probs (echo, top alternatives)
    grammar.py, structured.py   grammar-constrained decoding (xgrammar) and the structured-output fields
    tools/          tool calling: the call formats' parsers, forced choices, rendering, replies
    openai/         the HTTP API: request bodies, chat templates, Responses, the app and server
    listen.py       the listening socket
    gateway.py, transcript.py   the training gateway an agent process calls (envs/agent/)
"""
