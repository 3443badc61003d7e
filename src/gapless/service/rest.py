"""The SDK's RestClient routes (tinker 0.38) and `save_weights_external`, over service/checkpoints.py.

    GET    /api/v1/training_runs[?limit&offset]           list_training_runs (`tinker run list`)
    GET    /api/v1/training_runs/{run}                    get_training_run[_by_tinker_path]
    GET    /api/v1/training_runs/{run}/checkpoints        list_checkpoints (`tinker checkpoint list --run-id`)
    GET    /api/v1/checkpoints[?limit&offset]             list_user_checkpoints (`tinker checkpoint list`)
    DELETE /api/v1/training_runs/{run}/checkpoints/{kind}/{name}            delete_checkpoint
    PUT    .../checkpoints/{kind}/{name}/ttl                                set_checkpoint_ttl
    POST, DELETE .../checkpoints/{kind}/{name}/publish                      (un)publish: a flag
    GET    .../checkpoints/external_weights/{name}/external_weights_urls    signed per-file URLs
    GET    /api/v1/download/{run}/{name}/{file}?expires&sig                 one file (the signature is the key)
    POST   /api/v1/weights_info, /api/v1/copy_weights
    POST   /api/v1/save_weights_external                  a training call: a future, as the SDK expects

`tinker checkpoint download` and the cookbook's `weights.download` export a training checkpoint
with `save_weights_external` (export.py: a peft adapter or an HF model), fetch its files from
these URLs (plain GETs without the API key, as from cloud storage: each URL is signed with the
key, HMAC-SHA256, and expires after `URL_TTL_S`), then delete the export.
A single-user service: every run is "owned" by `local`, `access_scope` and projects are accepted
and ignored, and a copy's `destination_project_id` names nothing.
Errors: a path that is not a checkpoint path is a 400, an unknown run or checkpoint a 404
(`tinker.NotFoundError`), a bad download signature a 403.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from tinker import types as tt

from gapless.lora import LoraSpec
from gapless.service.checkpoints import CheckpointPath, check_ttl
from gapless.service.export import export_run
from gapless.service.models import UserError

URL_TTL_S = 3600
DOWNLOAD_PREFIX = "/api/v1/download/"


class CheckpointRoutes:
    def __init__(self, app):  # the TinkerApp (not imported: it imports this): store, pool, api_key, _run, _train
        self.app, self.store = app, app.store

    def routes(self) -> list[Route]:
        ckpt = "/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}"
        return [
            Route("/api/v1/training_runs", self.list_runs, methods=["GET"]),
            Route("/api/v1/training_runs/{run_id}", self.get_run, methods=["GET"]),
            Route("/api/v1/training_runs/{run_id}/checkpoints", self.list_run_checkpoints, methods=["GET"]),
            Route("/api/v1/checkpoints", self.list_all_checkpoints, methods=["GET"]),
            Route(ckpt, self.delete, methods=["DELETE"]),
            Route(f"{ckpt}/ttl", self.set_ttl, methods=["PUT"]),
            Route(f"{ckpt}/publish", self.publish, methods=["POST", "DELETE"]),
            Route(f"{ckpt}/external_weights_urls", self.external_urls, methods=["GET"]),
            Route(DOWNLOAD_PREFIX + "{run_id}/{name}/{file:path}", self.download, methods=["GET"]),
            Route("/api/v1/weights_info", self.weights_info, methods=["POST"]),
            Route("/api/v1/copy_weights", self.copy_weights, methods=["POST"]),
            Route("/api/v1/save_weights_external", self.save_weights_external, methods=["POST"]),
        ]

    # ---- listings ----------------------------------------------------------------------------
    async def list_runs(self, request: Request) -> Response:
        runs = self.store.training_runs()
        page, cursor = _page(runs, request)
        return _json(tt.TrainingRunsResponse(training_runs=page, cursor=cursor))

    async def get_run(self, request: Request) -> Response:
        run = self.store.training_run(request.path_params["run_id"])
        if run is None:
            return _not_found(f"no training run {request.path_params['run_id']!r}")
        return _json(run)

    async def list_run_checkpoints(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if self.store.run(run_id) is None:
            return _not_found(f"no training run {run_id!r}")
        return _json(tt.CheckpointsListResponse(checkpoints=self.store.checkpoints(run_id)))

    async def list_all_checkpoints(self, request: Request) -> Response:
        page, cursor = _page(self.store.checkpoints(), request, default_limit=100)
        return _json(tt.CheckpointsListResponse(checkpoints=page, cursor=cursor))

    async def weights_info(self, request: Request) -> Response:
        try:
            path = CheckpointPath.parse(str((await request.json()).get("tinker_path")))
            return _json(self.store.weights_info(path))
        except UserError as exc:
            return _not_found(str(exc))
        except (ValueError, AttributeError) as exc:
            return JSONResponse({"error": f"weights_info needs {{'tinker_path': ...}}: {exc}"}, status_code=400)

    # ---- one checkpoint ------------------------------------------------------------------------
    def _path(self, request: Request) -> CheckpointPath:
        p = request.path_params
        return CheckpointPath.parse(f"tinker://{p['run_id']}/{p['segment']}/{p['name']}")

    async def delete(self, request: Request) -> Response:
        try:
            path = self._path(request)
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if not self.store.delete(path):
            return _not_found(f"no checkpoint at {path.tinker_path!r}")
        return Response(status_code=204)

    async def set_ttl(self, request: Request) -> Response:
        try:
            path = self._path(request)
            ttl = (await request.json()).get("ttl_seconds")
            self.store.set_ttl(path, int(ttl) if ttl is not None else None)
        except UserError as exc:
            status = 404 if "no checkpoint" in str(exc) else 400
            return JSONResponse({"error": str(exc)}, status_code=status)
        return Response(status_code=204)

    async def publish(self, request: Request) -> Response:
        try:
            changed = self.store.set_public(self._path(request), request.method == "POST")
        except UserError as exc:
            return _not_found(str(exc))
        if not changed:
            state = "public" if request.method == "POST" else "private"
            return JSONResponse({"error": f"the checkpoint is {state} already"}, status_code=409)
        return Response(status_code=204)

    # ---- exports and their files ---------------------------------------------------------------
    async def save_weights_external(self, request: Request) -> Response:
        body = await _parse(tt.SaveWeightsExternalRequest, request)
        if isinstance(body, Response):
            return body

        def save() -> dict:
            run = self.app._run(body.model_id)
            path = CheckpointPath.parse(f"tinker://{run.model_id}/external_weights/{body.path}")
            directory = self.store.external_dir(path)
            check_ttl(body.ttl_seconds)
            if self.store.find(path) is not None or directory.exists():
                raise UserError(f"external weights {body.path!r} of {run.model_id} exist; pick another name")
            size = export_run(run, directory, body.age_encryption_recipients)
            self.store.add(path, body.ttl_seconds, size_bytes=size)
            return {"type": "save_weights_external", "path": path.tinker_path, "size_bytes": size}

        return self.app._train(save, body.model_id)

    async def external_urls(self, request: Request) -> Response:
        try:
            path = self._path(request)
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        directory = self.store.external_dir(path)
        if path.kind != "external" or self.store.find(path) is None or not directory.is_dir():
            return _not_found(f"no external weights at {path.tinker_path!r}")
        expires = int(time.time()) + URL_TTL_S
        base = str(request.base_url).rstrip("/")
        urls = {}
        for file in sorted(f for f in directory.rglob("*") if f.is_file()):
            rel = file.relative_to(directory).as_posix()
            route = f"{DOWNLOAD_PREFIX}{quote(path.run_id, safe='')}/{quote(path.name, safe='')}/{quote(rel)}"
            urls[rel] = f"{base}{route}?expires={expires}&sig={self._sign(path, rel, expires)}"
        when = datetime.fromtimestamp(expires, timezone.utc)
        return _json(tt.ExternalWeightsUrlsResponse(urls=urls, expires=when))

    def _sign(self, path: CheckpointPath, rel: str, expires: int) -> str:
        message = f"{path.run_id}\n{path.name}\n{rel}\n{expires}".encode()
        return hmac.new(self.app.api_key.encode(), message, hashlib.sha256).hexdigest()

    async def download(self, request: Request) -> Response:
        """A signed URL's file: no API key (urllib fetches it), the signature and expiry instead."""
        p = request.path_params
        path = CheckpointPath(p["run_id"], "external_weights", p["name"])
        try:
            expires = int(request.query_params.get("expires", "0"))
        except ValueError:
            expires = 0
        given = request.query_params.get("sig", "")
        if expires < time.time() or not hmac.compare_digest(given, self._sign(path, p["file"], expires)):
            return JSONResponse({"error": "the download URL is expired or not signed by this service"}, 403)
        directory = self.store.external_dir(path).resolve()
        file = (directory / p["file"]).resolve()
        if not file.is_relative_to(directory) or not file.is_file() or self.store.find(path) is None:
            return _not_found(f"no file {p['file']!r} in {path.tinker_path!r}")
        return FileResponse(file)

    async def copy_weights(self, request: Request) -> Response:
        body = await _parse(tt.CopyWeightsRequest, request)
        if isinstance(body, Response):
            return body
        try:
            source = CheckpointPath.parse(body.source_path)
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        run = self.store.run(source.run_id)
        if run is None or self.store.find(source) is None:
            return _not_found(f"no checkpoint at {source.tinker_path!r}")
        if body.session_id is not None and body.model_seq_id is not None:
            new_run = f"{body.session_id}:train:{body.model_seq_id}"
        else:
            new_run = f"copy-{uuid.uuid4().hex[:12]}"
        copy = CheckpointPath(new_run, source.segment, source.name)
        try:
            check_ttl(body.ttl_seconds)
        except UserError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        spec = None
        if run["is_lora"]:
            spec = LoraSpec(run["lora_rank"], run["train_attn"], run["train_mlp"], run["train_unembed"])
        self.store.record_run(new_run, run["base_model"], spec, run["user_metadata"], trainable=False)
        if source.kind == "sampler":
            self.app.pool.copy(source.tinker_path, copy.tinker_path)
        elif source.kind == "training":
            _link(self.store.training_file(source), self.store.training_file(copy))
        else:
            shutil.copytree(self.store.external_dir(source), self.store.external_dir(copy), copy_function=_link)
        self.store.add(copy, body.ttl_seconds, size_bytes=self.store.find(source).size_bytes)
        return _json(tt.CopyWeightsResponse(tinker_path=copy.tinker_path))


def _link(source, destination) -> None:
    """A hard link (the bytes are shared, and deleting either name keeps the other), else a copy."""
    Path(destination).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _page(items: list, request: Request, default_limit: int = 20):
    try:
        limit = int(request.query_params.get("limit", default_limit))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        limit, offset = default_limit, 0
    limit, offset = max(0, limit), max(0, offset)
    return items[offset : offset + limit], tt.Cursor(offset=offset, limit=limit, total_count=len(items))


async def _parse(model, request: Request):
    """The body as the SDK request type `model`, or a 400 naming what is wrong."""
    try:
        return model.model_validate(await request.json())
    except ValueError as exc:  # not JSON, or pydantic's ValidationError
        return JSONResponse({"error": f"{model.__name__}: {exc}"}, status_code=400)


def _json(model) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def _not_found(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=404)
