"""The Tinker API (as the official `tinker` SDK 0.38 speaks it) as an ASGI app over gapless.

    POST /api/v1/client/config, create_session, session_heartbeat, telemetry, sessions/{id}/finish
    POST /api/v1/create_model, get_info, forward_backward (protobuf), optim_step, save_weights,
         load_weights, save_weights_for_sampler                          -> the training thread
    POST /api/v1/create_sampling_session, asample; GET /api/v1/samplers/{id} -> the sampler pool
    POST /api/v1/retrieve_future                                         -> the future store
    GET  /api/v1/healthz, /api/v1/get_server_capabilities
    /api/v1/training_runs..., checkpoints, weights_info, copy_weights, save_weights_external,
         download/...                        -> service/rest.py over the CheckpointStore
    /v1/...  the OpenAI API (openai_models.py) over a base model or a tinker:// sampler path

Who waits for whom:

    SDK ── POST call ──> route: validate, register a future ──> {"request_id"} at once
                         training call ──> training thread (one, FIFO) ──┐
                         asample ──> SamplerPool scheduler (engine thread) ┤ resolve(Outcome)
    SDK ── POST retrieve_future ──> FutureStore.wait(hold_s) <────────────┘ result, or "try_again"

Every call of a training client runs on one thread in arrival order (the SDK posts a client's
calls one at a time, numbered by seq_id), so a client's forward_backward, optim_step and saves
apply in the order it made them; calls of different clients interleave but share no state.
Bad input from a client is accepted and fails its future with category "user" (the SDK raises
`RequestFailedError` with the message); a body the SDK could not have sent is a 400, a wrong or
missing `X-API-Key` a 401 (the SDK's `AuthenticationError`), an unknown future a 404.
A client that disconnects leaves nothing running on its behalf beyond the call it made: samples
finish (bounded by max_tokens) and their results expire after the store's TTL.
Not served: stable_reinforce and server-side custom losses (service/losses.py says why) and
record_stability_info (a user error), images, non-Adam optimizers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types as tt

from gapless.lora import LoraSpec
from gapless.serve.protocol import QueueFull, ServeError
from gapless.serve.scheduler import RequestHandle
from gapless.service import logprobs
from gapless.service.checkpoints import CheckpointPath, CheckpointStore, check_ttl
from gapless.service.futures import FutureStore, Outcome
from gapless.service.logprobs import LogprobOptions
from gapless.service.models import (
    AdamParams,
    BaseModels,
    TrainingRun,
    UserError,
    check_context,
    checkpoint_file,
    sampler_weights_of,
)
from gapless.service.params import scheduler_request
from gapless.service.rest import DOWNLOAD_PREFIX, CheckpointRoutes
from gapless.service.restarts import parse_sampler_path, restarted_message, resume_hint, sampler_file
from gapless.service.samplers import SamplerPool
from gapless.service.wire import SequenceOut, WireError, decode_forward_backward, encode_forward_backward, encode_sample

log = logging.getLogger("gapless.serve.tinker")
PROTO = "application/x-protobuf"


class TinkerApp:
    def __init__(
        self,
        bases: BaseModels,
        pool: SamplerPool,
        *,
        api_key: str,
        checkpoint_dir: str | Path,
        openai=None,
        hold_s: float = 20.0,
        ttl_s: float = 600.0,
        default_max_tokens: int = 256,
        micro_batch_tokens: int = 4096,
    ):
        self.bases, self.pool, self.api_key, self.micro_batch_tokens = bases, pool, api_key, micro_batch_tokens
        self.checkpoint_dir, self.hold_s, self.default_max_tokens = Path(checkpoint_dir), hold_s, default_max_tokens
        self.futures = FutureStore(ttl_s)
        self.store = CheckpointStore(self.checkpoint_dir, sampler_drop=pool.drop)
        self.store.start_sweeping()
        self.openai = openai  # an OpenAIApp over a base model's scheduler, served under /v1 (its own bearer check)
        self.runs: dict[str, TrainingRun] = {}  # model_id -> run (training thread only, after creation)
        self.sampling_sessions: dict[str, str] = {}  # sampling_session_id -> weights key
        self.sessions: set[str] = set()
        self.sessions_made: set[str] = set()  # every session of this process, finished ones too
        self._trainer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-trainer")
        self._tasks: set[asyncio.Task] = set()
        post = lambda path, fn: Route(f"/api/v1/{path}", fn, methods=["POST"])  # noqa: E731
        routes = [
            Route("/api/v1/healthz", lambda r: JSONResponse({"status": "ok"}), methods=["GET"]),
            Route("/api/v1/get_server_capabilities", self.capabilities, methods=["GET"]),
            Route("/api/v1/samplers/{sampler_id}", self.get_sampler, methods=["GET"]),
            post("client/config", self.client_config),
            post("create_session", self.create_session),
            post("session_heartbeat", lambda r: JSONResponse({"type": "session_heartbeat"})),
            post("telemetry", lambda r: JSONResponse({"status": "accepted"})),
            post("sessions/{session_id}/finish", self.finish_session),
            post("create_model", self.create_model),
            post("get_info", self.get_info),
            post("forward_backward", self.forward_backward),
            post("optim_step", self.optim_step),
            post("save_weights", self.save_weights),
            post("load_weights", self.load_weights),
            post("save_weights_for_sampler", self.save_for_sampler),
            post("create_sampling_session", self.create_sampling_session),
            post("asample", self.asample),
            post("retrieve_future", self.retrieve_future),
            *CheckpointRoutes(self).routes(),  # the RestClient's checkpoint and run routes (service/rest.py)
        ]
        self.app = Starlette(routes=routes, exception_handlers={Exception: _internal_error})

    async def __call__(self, scope, receive, send) -> None:
        if self.openai is not None and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            return await self.openai(scope, receive, send)
        # signed download URLs carry their own proof (rest.py), as cloud-storage URLs do
        if (
            scope["type"] == "http"
            and scope["path"] != "/api/v1/healthz"
            and not scope["path"].startswith(DOWNLOAD_PREFIX)
        ):
            given = dict(scope["headers"]).get(b"x-api-key", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                response = JSONResponse(
                    {
                        "error": "invalid or missing API key: give the service's key as TINKER_API_KEY "
                        "or ServiceClient(api_key=...)"
                    },
                    status_code=401,
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def close(self) -> None:
        self.store.close()
        self._trainer.shutdown(wait=True, cancel_futures=True)
        self.pool.close()

    # ---- session ----------------------------------------------------------------------------
    async def client_config(self, request: Request) -> Response:
        # serial forward_backward chunks: the training thread then sees a client's calls in seq_id order
        return JSONResponse({"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False})

    async def create_session(self, request: Request) -> Response:
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        self.sessions.add(session_id)
        self.sessions_made.add(session_id)
        return JSONResponse({"type": "create_session", "session_id": session_id})

    async def finish_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        self.sessions.discard(session_id)
        prefix = f"{session_id}:"

        def drop() -> None:  # on the training thread, after the session's queued calls
            for model_id in [m for m in self.runs if m.startswith(prefix)]:
                self.runs.pop(model_id).close()

        self._trainer.submit(drop)
        return JSONResponse({})

    async def capabilities(self, request: Request) -> Response:
        models = [
            {
                "model_name": name,
                "max_context_length": self.bases.get(name).context,
                "trainable": True,
                "sampleable": True,
            }
            for name in self.bases.names
        ]
        return JSONResponse({"supported_models": models})

    # ---- training -----------------------------------------------------------------------------
    async def create_model(self, request: Request) -> Response:
        body = await _parse(tt.CreateModelRequest, request)
        if isinstance(body, Response):
            return body
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        lora = body.lora_config

        def create() -> dict:
            base = self.bases.get(body.base_model)
            spec = None
            if lora is not None:
                spec = LoraSpec(
                    rank=lora.rank,
                    train_attn=lora.train_attn,
                    train_mlp=lora.train_mlp,
                    train_unembed=lora.train_unembed,
                    seed=lora.seed if lora.seed is not None else 0,
                )
            try:
                self.runs[model_id] = TrainingRun(model_id, base, spec, self.micro_batch_tokens)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            self.store.record_run(model_id, base.name, spec, body.user_metadata)
            return {"type": "create_model", "model_id": model_id}

        return self._train(create, model_id)

    async def get_info(self, request: Request) -> Response:
        body = await _parse(tt.GetInfoRequest, request)
        if isinstance(body, Response):
            return body
        run = self.runs.get(body.model_id)
        if run is None:
            return JSONResponse({"error": f"unknown model_id {body.model_id!r}"}, status_code=404)
        config = run.base.policy.model.config
        return JSONResponse(
            {
                "type": "get_info",
                "model_id": run.model_id,
                "model_name": run.base.name,
                "is_lora": run.spec is not None,
                "lora_rank": run.spec.rank if run.spec else None,
                "model_data": {
                    "arch": config.model_type,
                    "model_name": run.base.name,
                    "tokenizer_id": run.base.tokenizer_dir,
                },
            }
        )

    async def forward_backward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            call = decode_forward_backward(raw)
        except WireError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

        def run() -> Outcome:
            logprobs, metrics = self._run(call.model_id).forward_backward(
                call.datums, call.loss_fn, call.config, call.forward_only
            )
            return Outcome(proto=encode_forward_backward(logprobs, metrics))

        return self._train(run, call.model_id)

    async def optim_step(self, request: Request) -> Response:
        body = await _parse(tt.OptimStepRequest, request)
        if isinstance(body, Response):
            return body
        params = body.optim_params

        def step() -> dict:
            if not isinstance(params, tt.AdamParams):
                raise UserError(
                    f"only Adam is served (got optimizer {getattr(params, 'type', type(params).__name__)!r})"
                )
            adam = AdamParams(
                params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay, params.grad_clip_norm
            )
            return {"type": "optim_step", "metrics": self._run(body.model_id).optim_step(adam)}

        return self._train(step, body.model_id)

    async def save_weights(self, request: Request) -> Response:
        body = await _parse(tt.SaveWeightsRequest, request)
        if isinstance(body, Response):
            return body

        def save() -> dict:
            run = self._run(body.model_id)
            name = body.path or f"step-{run.steps:06d}"
            path = checkpoint_file(self.checkpoint_dir, run.model_id, name)
            check_ttl(body.ttl_seconds)
            if path.exists() and not getattr(body, "overwrite", False):
                raise UserError(f"checkpoint {name!r} of {run.model_id} exists; pick another name or pass overwrite")
            run.save(path)
            saved = CheckpointPath(run.model_id, "weights", name)
            self.store.add(saved, body.ttl_seconds, body.user_metadata)
            return {"type": "save_weights", "path": saved.tinker_path}

        return self._train(save, body.model_id)

    async def load_weights(self, request: Request) -> Response:
        body = await _parse(tt.LoadWeightsRequest, request)
        if isinstance(body, Response):
            return body
        # create_training_client_from_state sends session_id + model_seq_id and expects this model id
        model_id = body.model_id or f"{body.session_id}:train:{body.model_seq_id}"

        def load() -> dict:
            payload = self._read_checkpoint(body.path)
            run = self.runs.get(model_id)
            if run is None:
                base = self.bases.get(payload["base"])
                run = self.runs[model_id] = TrainingRun(model_id, base, payload["spec"], self.micro_batch_tokens)
                self.store.record_run(model_id, base.name, payload["spec"], body.user_metadata)
            run.load(payload, with_optimizer=bool(body.optimizer))
            return {"type": "load_weights", "path": body.path, "model_id": model_id}

        return self._train(load, model_id)

    async def save_for_sampler(self, request: Request) -> Response:
        body = await _parse(tt.SaveWeightsForSamplerRequest, request)
        if isinstance(body, Response):
            return body

        def save() -> dict:
            run = self._run(body.model_id)
            check_ttl(body.ttl_seconds)
            name = body.path or f"ephemeral-{body.seq_id}"
            path = f"tinker://{run.model_id}/sampler_weights/{name}"
            self.pool.register(path, run.base.name, run.sampler_state())
            if body.path is not None:  # named: on disk (it outlives the process, restarts.py) and listed
                run.save(sampler_file(self.checkpoint_dir, run.model_id, name), with_optimizer=False)
                self.store.add(CheckpointPath.parse(path), body.ttl_seconds, body.user_metadata)
            if body.path is None:  # save_weights_and_get_sampling_client: a session on these weights
                session = f"samp-{uuid.uuid4().hex[:12]}"
                self.sampling_sessions[session] = path
                return {"type": "save_weights_for_sampler", "path": path, "sampling_session_id": session}
            return {"type": "save_weights_for_sampler", "path": path}

        return self._train(save, body.model_id)

    def _run(self, model_id: str) -> TrainingRun:
        run = self.runs.get(model_id)
        if run is None and model_id.partition(":")[0] not in self.sessions_made:  # made by an earlier process
            raise UserError(
                f"unknown model_id {model_id!r}: the service restarted since it was created; "
                + resume_hint(self.checkpoint_dir, model_id)
            )
        if run is None:
            raise UserError(f"unknown model_id {model_id!r}: create a training client first (or its session finished)")
        return run

    async def _reload_snapshot(self, key: str) -> None:
        """Sampler weights saved with a name but not in memory (saved before a restart, or dropped
        from the pool): read back from disk, merged on the training thread, registered."""
        if self.pool.holds(key) or (parsed := parse_sampler_path(key)) is None:
            return
        file = sampler_file(self.checkpoint_dir, *parsed)
        if not file.is_file():
            return  # the pool's own error says what is missing

        def reload() -> None:
            payload = torch.load(file, weights_only=False)
            base = self.bases.get(payload["base"])
            self.pool.register(key, base.name, sampler_weights_of(payload, base))

        await asyncio.wrap_future(self._trainer.submit(reload))

    def _read_checkpoint(self, tinker_path: str) -> dict:
        prefix = "tinker://"
        parts = tinker_path[len(prefix) :].split("/") if tinker_path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != "weights":
            raise UserError(f"checkpoint path {tinker_path!r} is not tinker://MODEL_ID/weights/NAME (from save_state)")
        self.store.sweep()  # an expired checkpoint is gone
        file = checkpoint_file(self.checkpoint_dir, parts[0], parts[2])
        if not file.is_file():
            raise UserError(f"no checkpoint at {tinker_path!r} (looked in {file})")
        return torch.load(file, weights_only=False)

    def _train(self, work: Callable[[], dict | Outcome], model_id: str | None) -> Response:
        """Queue `work` on the training thread; answer the SDK with the future of its outcome."""
        request_id = self.futures.create(model_id)
        if model_id is not None:
            self.store.touch(model_id)

        def run() -> None:
            try:
                result = work()
                outcome = result if isinstance(result, Outcome) else Outcome(json=result)
            except UserError as exc:
                outcome = Outcome(error=str(exc), category="user")
            except Exception as exc:  # noqa: BLE001 -- the client learns why; the service lives on
                log.exception("training call failed")
                outcome = Outcome(error=f"the service failed: {type(exc).__name__}: {exc}", category="server")
            self.futures.resolve(request_id, outcome)

        self._trainer.submit(run)
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    # ---- sampling -----------------------------------------------------------------------------
    async def create_sampling_session(self, request: Request) -> Response:
        body = await _parse(tt.CreateSamplingSessionRequest, request)
        if isinstance(body, Response):
            return body
        key = body.model_path or body.base_model
        if key is None:
            return JSONResponse({"error": "create_sampling_session needs model_path or base_model"}, status_code=400)
        self.store.sweep_samplers()  # expired sampler weights are gone
        await self._reload_snapshot(key)
        try:
            self.pool.base_of(key)
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        session = f"samp-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session] = key
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": session})

    async def get_sampler(self, request: Request) -> Response:
        sampler_id = request.path_params["sampler_id"]
        if sampler_id not in self.sampling_sessions:
            return JSONResponse({"error": f"unknown sampler {sampler_id!r}"}, status_code=404)
        key = self.sampling_sessions[sampler_id]
        return JSONResponse(
            {
                "sampler_id": sampler_id,
                "base_model": self.pool.base_of(key).name,
                "model_path": key if key.startswith("tinker://") else None,
            }
        )

    async def asample(self, request: Request) -> Response:
        """Submit before answering, so a full scheduler is a 429 the SDK backs off on and retries;
        bad input is accepted and fails its future (a user error the SDK raises)."""
        body = await _parse(tt.SampleRequest, request)
        if isinstance(body, Response):
            return body
        try:
            key, handle, options = await self._submit(body)
        except QueueFull as exc:
            return JSONResponse({"error": exc.message}, status_code=429, headers={"Retry-After": "1"})
        except (UserError, ServeError) as exc:
            key, handle, options = None, getattr(exc, "message", str(exc)), None
        request_id = self.futures.create(key)
        task = asyncio.create_task(self._finish_sample(request_id, key, handle, options))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return JSONResponse(
            {"request_id": request_id, "sample_sequence_ids": [f"{request_id}/{j}" for j in range(body.num_samples)]}
        )

    async def _submit(self, body: tt.SampleRequest) -> tuple[str, RequestHandle, LogprobOptions]:
        key = self.sampling_sessions.get(body.sampling_session_id or "") or body.model_path or body.base_model
        if key is None:
            raise UserError(f"unknown sampling session {body.sampling_session_id!r}: create a sampling client first")
        self.store.sweep_samplers()
        await self._reload_snapshot(key)
        base = self.pool.base_of(key)
        text = [c for c in body.prompt.chunks if isinstance(c, tt.EncodedTextChunk)]
        check_context(base, sum(len(c.tokens) for c in text), "the prompt")
        request = scheduler_request(body, base.vocab_size, base.context, self.default_max_tokens)
        room = base.context - len(request.prompt_ids)
        fix = f"shorten it (max_tokens {room} or less fits this prompt; the service's service.max_seq_len sets the context)"
        check_context(base, len(request.prompt_ids) + request.params.max_new_tokens, "the prompt plus max_tokens", fix)
        options = logprobs.requested(body, list(request.prompt_ids), base.vocab_size, request.params.seed)
        # off the loop: the first request on new weights builds an engine (or swaps one's weights)
        return key, await asyncio.to_thread(self.pool.submit, key, request), options

    async def _finish_sample(
        self, request_id: str, key: str | None, handle: RequestHandle | str, options: LogprobOptions | None
    ) -> None:
        try:
            if isinstance(handle, str):  # refused at submit: the message
                raise UserError(handle)
            try:
                results = await handle.aresult()
            finally:
                handle.abort()  # a no-op once finished; frees the engine if this task was cancelled
            extras = None
            if options.needs_prompt_pass or options.topk_sample:
                prompt, samples = list(handle.request.prompt_ids), [list(r.token_ids) for r in results]
                model = (await asyncio.to_thread(self.pool.scorer, key)).model
                extras = await asyncio.to_thread(logprobs.compute, model, prompt, samples, options)
            sequences = [SequenceOut(r.token_ids, r.logprobs, r.finish_reason == "length") for r in results]
            outcome = Outcome(proto=encode_sample(sequences, extras))
        except (UserError, ServeError) as exc:
            outcome = Outcome(error=getattr(exc, "message", str(exc)), category="user")
        except Exception as exc:  # noqa: BLE001 -- the client learns why; the service lives on
            log.exception("sampling failed")
            outcome = Outcome(error=f"the service failed: {type(exc).__name__}: {exc}", category="server")
        self.futures.resolve(request_id, outcome)

    # ---- futures ------------------------------------------------------------------------------
    async def retrieve_future(self, request: Request) -> Response:
        body = await _parse(tt.FutureRetrieveRequest, request)
        if isinstance(body, Response):
            return body
        if not self.futures.known(body.request_id):
            earlier, tag = self.futures.earlier(body.request_id)
            if earlier:  # the SDK raises this as RequestFailedError with the message
                return JSONResponse({"error": restarted_message(self.checkpoint_dir, tag), "category": "server"})
            return JSONResponse({"error": f"unknown or expired future {body.request_id!r}"}, status_code=404)
        outcome = await self.futures.wait(body.request_id, self.hold_s)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if outcome.error is not None:
            return JSONResponse({"error": outcome.error, "category": outcome.category})
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTO)
        return JSONResponse(outcome.json)


async def _json(request: Request):
    try:
        return await request.json()
    except ValueError as exc:
        return JSONResponse({"error": f"the body is not JSON: {exc}"}, status_code=400)


async def _parse(model, request_or_data):
    data = await _json(request_or_data) if isinstance(request_or_data, Request) else request_or_data
    if isinstance(data, Response):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return JSONResponse({"error": f"{model.__name__}: {where}: {first['msg']}"}, status_code=400)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("tinker route failed", exc_info=exc)
    return JSONResponse({"error": f"the service failed: {type(exc).__name__}: {exc}"}, status_code=500)
