"""Serving a policy: one request scheduler per served model, shared by every client, and the
OpenAI-compatible HTTP API over it (`gapless serve`; docs/serving.md).

    protocol.py     typed records (SampleRequest, SampleDelta, SampleResult) and ServeErrors
    scheduler.py    the engine thread: requests in, per-step deltas out, abort, admission
    detokenize.py   incremental text, stop strings
    openai_params.py / chat.py / scoring.py   request bodies, chat templates, extra log-probs
    openai_app.py   the Starlette app;  openai_server.py / listen.py   uvicorn and the socket
"""
