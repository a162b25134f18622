"""The FastAPI application: `create_app(settings)`; `tinyloop serve` runs it under uvicorn.

Middleware is plain ASGI (no BaseHTTPMiddleware), so streaming responses still see client disconnects.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi import HTTPException

from .. import __version__, store  # noqa: F401 - store: hf: model names resolve (and pull on first use)
from ..model.fast import executor_name
from . import access, anthropic, docs_ui, embeddings, errors, lmstudio, native, openai, openai_responses, playground
from . import openapi as server_openapi
from .errors import APIError
from .generation import ServerState, served_names
from .metrics import Metrics
from .settings import Settings
from .worker import EngineWorker

log = logging.getLogger("tinyloop.server")
OPEN_PATHS = {"/health", *playground.PATHS, *docs_ui.PATHS}  # the playground's and /docs' files hold no model data


class GateMiddleware:
    """API-key auth (all paths but /health, the playground's and /docs' files): the key as a bearer token
    (`Authorization: Bearer <key>`, OpenAI's clients) or in `x-api-key` (Anthropic's); the request body
    limit (413) and request metrics. Errors take the shape of the API under the path (errors.shape_for)."""

    def __init__(self, app, settings: Settings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_tracked(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._gate(scope, receive, send_tracked)
        finally:
            self.metrics.requests.labels(access.route_label(scope), scope.get("method", ""), str(status["code"])).inc()

    async def _gate(self, scope, receive, send):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        keys = self.settings.api_keys
        path = scope["path"]
        if keys and path not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            x_key = headers.get("x-api-key", "").strip()
            # every key compared with every credential sent, in constant time each: the time taken says
            # nothing about which matched
            if not sum(hmac.compare_digest(given.encode("latin-1"), k.encode())
                       for given in (bearer, x_key) if given for k in keys):
                why = "missing" if not (auth or x_key) else "invalid"
                return await errors.send_error(send, APIError(
                    401, f"{why} API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), path)
        limit = self.settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await errors.send_error(send, APIError(413, f"request body of {length} bytes is over the "
                                                               f"{limit}-byte limit", code="request_too_large"), path)
        seen = 0

        async def receive_limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body is over the {limit}-byte limit")
            return message

        await self.app(scope, receive_limited, send)


def create_app(settings: Settings | None = None, *, loader=None, worker_factory=None,
               metrics: Metrics | None = None) -> FastAPI:
    """The app. `worker_factory(settings, metrics)` replaces the in-process `EngineWorker` (scale-out: a
    worker that forwards planned requests to engine replicas); `metrics` what `/metrics` renders."""
    settings = settings or Settings.from_env()
    metrics = metrics or Metrics()
    worker = (worker_factory or (lambda s, m: EngineWorker(s, m, loader=loader)))(settings, metrics)
    from ..modelfile import resolve_model_path

    path = resolve_model_path(settings.model_path)
    try:
        created = int(path.stat().st_mtime)
    except OSError:
        created = int(time.time())
    state = ServerState(settings, worker, metrics, names=served_names(settings.served_model_names, path),
                        created=created)
    state.model_path = str(path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        for w in settings.warnings:
            log.warning(w)
        yield
        worker.stop()

    app = FastAPI(title="TinyLoop", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tl = state
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(lmstudio.router)
    app.include_router(anthropic.router)   # Anthropic's Messages API (/v1/messages)
    app.include_router(openai_responses.router)   # OpenAI's Responses API (/v1/responses)
    app.include_router(embeddings.router)   # OpenAI's embeddings (/v1/embeddings), on the same engine core
    app.include_router(native.router)
    app.include_router(playground.router)
    app.include_router(docs_ui.router)   # /docs with Swagger UI's files served from here (no CDN)

    @app.get("/health")
    async def health():
        base: dict[str, Any] = {"model": state.model_path, "model_id": state.model_id, "version": __version__, "commit": settings.commit,
                                "kv_cache_mode": settings.kv_cache_mode, "warnings": worker.warnings}
        if worker.state == "ready":
            engine = worker.engine
            out = {"status": "ok", **base, "kv_cache_mode": engine.kv_format,
                   "kv_cache_mode_requested": settings.kv_cache_mode, "max_seq_len": engine.max_seq_len,
                   "executor": executor_name(engine.model), **worker.health()}
            if out["status"] in ("ok", "degraded"):
                return out
            # loaded but not serving yet (scale-out: no engine replica ready): 503, so readiness waits
            err = APIError(503, out.get("reason") or "not serving yet", code="not_ready", headers={"Retry-After": "1"})
            return JSONResponse({**out, **err.body()}, status_code=503, headers=err.headers)
        try:
            worker.require_engine()
        except APIError as err:
            return JSONResponse({"status": worker.state, "reason": err.message if worker.state == "loading"
                                 else worker.error, **base, **err.body()}, status_code=503,
                                headers=err.headers)

    @app.get("/metrics")
    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_middleware(GateMiddleware, settings=settings, metrics=metrics)
    access.install_cors(app, settings.cors_origins)
    app.add_middleware(access.AccessMiddleware)
    server_openapi.install(app, state)
    return app


def serve(settings: Settings, *, host: str, port: int, log_level: str = "info") -> None:
    """Run the app under uvicorn. On SIGINT/SIGTERM the engine stops taking requests at once and gives
    in-flight ones `shutdown_grace_s` to finish (then fails them with an error event), while uvicorn
    waits for their connections to close."""
    import uvicorn

    app = create_app(settings)
    worker = app.state.tl.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.begin_shutdown()
            super().handle_exit(sig, frame)

    access.setup_logging(settings.log_format, log_level)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,  # ours has ids
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5)
    Server(config).run()
