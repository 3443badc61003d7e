"""The service's OpenAI routes (`/v1`) for every model it can sample: a base model, or any
`tinker://.../sampler_weights/...` path given as the request's `model`.

    ModelRouter(first, pool, api_key)   ASGI: reads a POST body's `model`; a sampler path goes to an
                                        OpenAIApp over that path's weights, anything else to `first`

A path's OpenAIApp (serve/openai/app.py, unchanged) runs over the pool's `pinned(path)` view,
whose `submit` is the pool's (samplers.py): the request joins that path's engine under the lock
that re-keys engines, so it never samples other weights even when the pool moves an idle engine
to another snapshot. Its tokenizer is the base model's.
Guaranteed: a body is read once and handed on unchanged (a body past `first`'s size limit goes
to `first` without its `model` being read, and `first` refuses it); a `tinker://` model the pool
does not hold (never saved, deleted or dropped) is an OpenAI-shaped 404 naming it. Not
guaranteed: `/v1/models` listing the sampler paths (it lists `first`'s model).
"""

from __future__ import annotations

import json
from collections import OrderedDict

from starlette.responses import JSONResponse

from gapless.serve.openai.app import OpenAIApp
from gapless.service.models import UserError
from gapless.service.samplers import SamplerPool


class PathScorer:
    def __init__(self, pool: SamplerPool, path: str):
        self.pool, self.path = pool, path

    def score(self, *args):
        return self.pool.scorer(self.path).score(*args)


class ModelRouter:
    def __init__(self, first: OpenAIApp, pool: SamplerPool, api_key: str, max_apps: int = 16):
        self.first, self.pool, self.api_key, self.max_apps = first, pool, api_key, max_apps
        self.max_peek_bytes = first.max_body_bytes
        self._apps: OrderedDict[str, OpenAIApp] = OrderedDict()

    def __getattr__(self, name):  # the first app's attributes (scheduler, scorer) for callers that read them
        return getattr(self.first, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.first(scope, receive, send)
        chunks, more, size = [], True, 0
        while more and size <= self.max_peek_bytes:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        replay = _replay(b"".join(chunks), more, receive)
        model = _model_of(b"".join(chunks)) if not more else None
        if not isinstance(model, str) or not model.startswith("tinker://"):
            return await self.first(scope, replay, send)
        try:
            app = self._app(model)
        except UserError as exc:
            body = {"error": {"message": str(exc), "type": "invalid_request_error", "param": "model", "code": None}}
            return await JSONResponse(body, status_code=404)(scope, receive, send)
        await app(scope, replay, send)

    def _app(self, path: str) -> OpenAIApp:
        base = self.pool.base_of(path)  # UserError: not a sampler path the pool holds
        if path not in self._apps:
            self._apps[path] = OpenAIApp(
                self.pool.pinned(path),
                base.policy.tokenizer,
                path,
                scorer=PathScorer(self.pool, path),
                api_key=self.api_key,
            )
            while len(self._apps) > self.max_apps:
                self._apps.popitem(last=False)
        self._apps.move_to_end(path)
        return self._apps[path]


def _model_of(body: bytes):
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("model") if isinstance(data, dict) else None


def _replay(body: bytes, more: bool, receive):
    """A `receive` that hands back the body read so far, then whatever the client sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": more}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay
