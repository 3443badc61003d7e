"""`gapless serve`: a checkpoint's scheduler behind the OpenAI API (openai/app.py) on uvicorn.

One process: uvicorn's event loop (uvloop + httptools, one worker, listen backlog 2048) handles
HTTP; the scheduler's engine thread runs the model. Torch releases the GIL inside its kernels, so
the loop stays responsive while the engine decodes; `threads` sets torch's intra-op threads
(default: all cores but one, which is left to the HTTP loop).

    serve(path, sock, ...) the command, on a socket bound by listen.bind (a port in use is a
                           one-line `PortInUse` before the model loads): prints "serving PATH at
                           URL", runs until Ctrl-C, then aborts what is in flight and returns
    ServerThread(app)      the same server from a background thread (tests, in-process users)
    build_app(policy, ...) a scheduler over an engine for `policy` (the torch engine, or vLLM:
                           `engine`, generate.serving_engine), and the app over it

Bind to 127.0.0.1 (the default) unless the network is trusted; `api_key` adds a bearer-token
check, not transport security (there is no TLS).
"""

from __future__ import annotations

import socket
import threading

import torch
import uvicorn

from gapless.config import usable_cores
from gapless.generate import serving_engine
from gapless.generate.families import require_engine
from gapless.models import Policy
from gapless.serve.listen import BACKLOG, bind, url_of
from gapless.serve.openai.app import OpenAIApp
from gapless.serve.scheduler import Scheduler
from gapless.serve.scoring import Scorer


def build_app(
    policy: Policy,
    model_name: str,
    *,
    max_batch: int = 64,
    max_samples: int = 512,
    api_key: str | None = None,
    max_seq_len: int | None = None,
    kernels: str = "auto",
    engine: str = "torch",
    model_dir: str | None = None,
    prefix_cache_mb: int = 0,
    log=print,
) -> OpenAIApp:
    """`model_dir`: the checkpoint vLLM loads (engine 'vllm'; `policy` is saved there if it holds none)."""
    engine = serving_engine(
        engine,
        policy,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        kernels=kernels,
        model_dir=model_dir or "",
        prefix_cache_mb=prefix_cache_mb,
        log=log,
    )
    scheduler = Scheduler(engine, policy.decode, max_samples=max_samples)
    return OpenAIApp(scheduler, policy.tokenizer, model_name, scorer=Scorer(policy.model), api_key=api_key)


def _config(app: OpenAIApp) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        loop="auto",
        http="auto",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=BACKLOG,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    )


class ServerThread:
    """uvicorn serving `app` from a daemon thread; `url` is ready when the constructor returns."""

    def __init__(self, app: OpenAIApp, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self._sock = bind(host, port)
        self.url = url_of(self._sock)
        self._server = uvicorn.Server(_config(app))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="openai-server", daemon=True
        )
        self._thread.start()

    def close(self, scheduler: bool = True) -> None:
        """Stop serving; with `scheduler`, also abort what is in flight and stop the engine thread."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
        if scheduler:
            self.app.scheduler.close()


DEFAULT_CONTEXT = 2048  # each KV-cache slot is preallocated at this length


def serve(
    model_path: str,
    sock: socket.socket,
    model_name: str | None = None,
    threads: int | None = None,
    api_key: str | None = None,
    max_batch: int = 64,
    max_seq_len: int | None = None,
    engine: str = "torch",
    prefix_cache_mb: int = 256,
    log=print,
) -> None:
    """Load a local checkpoint and serve it on the bound `sock` (listen.bind) until interrupted.
    `max_seq_len`: the served context (prompt + completion), default min(the model's, 2048);
    `engine`: 'torch' or 'vllm' (vLLM loads the checkpoint directory itself); `prefix_cache_mb`:
    the torch engine's prefix cache (generate/prefix_cache.py), 0 = off."""
    from gapless.models import load_local

    torch.set_num_threads(threads or max(1, usable_cores() - 1))
    policy = load_local(model_path)
    require_engine(policy.model)
    context = max_seq_len or min(DEFAULT_CONTEXT, policy.model.config.max_position_embeddings)
    app = build_app(
        policy,
        model_name or model_path,
        max_batch=max_batch,
        api_key=api_key,
        max_seq_len=context,
        engine=engine,
        model_dir=model_path,
        prefix_cache_mb=prefix_cache_mb,
        log=lambda line: log(line, flush=True),
    )
    log(f"serving {model_path} at {url_of(sock)}", flush=True)
    log(f"{engine} engine, context {context} tokens, up to {max_batch} sequences at once", flush=True)
    try:
        uvicorn.Server(_config(app)).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn has shut down gracefully and re-raised the signal
    finally:
        app.scheduler.close()
        sock.close()
