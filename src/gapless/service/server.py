"""`gapless serve-training`: the Tinker-compatible training service (service/app.py) on uvicorn.

The same stack as `gapless serve` (openai/server.py): one process, uvicorn's loop for HTTP
(listen.bind's socket, the same uvicorn settings), the sampling schedulers' engine threads, and
one training thread. The SDK's `base_url` is the server root (`http://HOST:PORT`).

    build_service(cfg, api_key)  the app over the configured base models (none: gapless-tiny), with the
                                 OpenAI API (`/v1`, bearer KEY) over the first one's sampling scheduler
                                 and over any tinker:// sampler path named as `model`; sampling on
                                 `generator.engine` ('torch' or 'vllm': one base model)
    ServiceThread(app)           the service from a background thread (tests, benchmarks)
    serve(cfg, sock, api_key)    the command: runs until Ctrl-C

Bind to loopback (the default) unless the network is trusted: the API key is a shared secret
sent in clear (there is no TLS).
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import uvicorn

from gapless.config import Config, ConfigError, usable_cores
from gapless.models import Policy
from gapless.serve.openai.app import OpenAIApp
from gapless.serve.openai.server import ServerThread, _config
from gapless.serve.scoring import Scorer
from gapless.service.app import TinkerApp
from gapless.service.arithmetic_base import chat_arithmetic_model
from gapless.service.models import BaseModels
from gapless.service.openai_models import ModelRouter
from gapless.service.samplers import SamplerPool


def default_model(cfg: Config, log=print) -> Policy:
    """The embedded tiny model as `gapless train` starts from it (warm start cached by content hash)."""
    from gapless.envs.registry import make_environment
    from gapless.orchestrate.policy_setup import prepare_policy

    env = make_environment(cfg)
    try:
        policy, _ = prepare_policy(cfg, env, log)
    finally:
        if callable(close := getattr(env, "close", None)):  # a code task's sandbox: not needed to serve
            close()
    return policy


def sampling_engine(cfg: Config) -> str:
    """The engine the samplers run (`generator.engine`), or a `ConfigError` naming the field."""
    engine = cfg.generator.engine
    if engine == "reference":
        raise ConfigError(
            "generator.engine = 'reference' does not stream: serve-training samples with 'torch' or 'vllm'"
        )
    if engine == "vllm" and len(cfg.service.base_models) > 1:
        raise ConfigError(
            f"service.base_models lists {len(cfg.service.base_models)} models, and the vLLM engine serves one per "
            "process (it sizes its cache from the memory it finds): list one, or use generator.engine = 'torch'"
        )
    return engine


def build_service(cfg: Config, api_key: str, log=print) -> TinkerApp:
    s = cfg.service
    engine = sampling_engine(cfg)
    bases = BaseModels(
        s.base_models,
        builtin=lambda: default_model(cfg, log),
        builtins={"chat_arithmetic": lambda: chat_arithmetic_model(cfg, log)},
        tokenizer_root=Path(s.checkpoint_dir) / "tokenizers",
        max_seq_len=s.max_seq_len,
        export_tokenizers=s.export_tokenizers,
        log=log,
    )
    pool = SamplerPool(
        bases,
        max_engines=s.max_engines,
        max_batch=s.max_batch,
        max_snapshots=s.max_snapshots,
        engine=engine,
        work_dir=s.checkpoint_dir,
        prefix_cache_mb=s.prefix_cache_mb,
    )
    for name in bases.names:  # every base model loaded (and its tokenizer exported) before any request
        bases.get(name)
    name = bases.names[0]  # the OpenAI routes serve the first base model, on its sampling scheduler
    base = bases.get(name)
    first = OpenAIApp(pool.pinned(name), base.policy.tokenizer, name, scorer=Scorer(base.policy.model), api_key=api_key)
    openai = ModelRouter(first, pool, api_key)  # and any tinker:// sampler path given as `model`
    return TinkerApp(
        bases,
        pool,
        api_key=api_key,
        checkpoint_dir=s.checkpoint_dir,
        hold_s=s.poll_hold_s,
        ttl_s=s.result_ttl_s,
        micro_batch_tokens=s.micro_batch_tokens,
        openai=openai,
    )


class ServiceThread(ServerThread):
    """uvicorn serving a TinkerApp from a daemon thread; `base_url` is what the SDK takes."""

    def __init__(self, app: TinkerApp, host: str = "127.0.0.1", port: int = 0):
        super().__init__(app, host, port)
        self.base_url = self.url.removesuffix("/v1")

    def close(self, scheduler: bool = True) -> None:
        super().close(scheduler=False)
        if scheduler:
            self.app.close()


def serve(cfg: Config, sock: socket.socket, api_key: str, threads: int | None = None, log=print) -> None:
    torch.set_num_threads(threads or max(1, usable_cores() - 1))
    app = build_service(cfg, api_key, log)
    names = ", ".join(app.bases.names)
    host, port = sock.getsockname()[:2]
    log(f"serving the Tinker API for {names} at http://{host}:{port} (set TINKER_BASE_URL to it)", flush=True)
    log(f"and the OpenAI API for {app.bases.names[0]} at http://{host}:{port}/v1 (bearer: the same key)", flush=True)
    try:
        uvicorn.Server(_config(app)).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        app.close()
        sock.close()
