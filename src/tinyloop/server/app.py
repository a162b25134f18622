"""The FastAPI application: `create_app(settings)`; `tinyloop serve` runs it under uvicorn.

Middleware is plain ASGI (no BaseHTTPMiddleware), so streaming responses still see client disconnects.
"""

from __future__ import annotations

import hmac
import json
import logging
import sys
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi import HTTPException

from .. import __version__, store  # noqa: F401 - store: hf: model names resolve (and pull on first use)
from ..errors import ModelFileError
from ..modelfile.header import held_params, weights_format
from . import access, docs_ui, errors, playground
from .anthropic import routes as anthropic
from .native import routes as native
from .openai import embeddings, lmstudio
from .openai import routes as openai
from .responses import routes as openai_responses
from . import openapi as server_openapi
from . import cache_routes
from .errors import APIError
from .models import LeaseMiddleware, build_pool
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

        if scope.get("method") in BODY_METHODS and not _is_json(headers.get("content-type")):
            return await self._not_json(scope, receive_limited, send, headers, path)
        await self.app(scope, receive_limited, send)

    async def _not_json(self, scope, receive, send, headers: dict[str, str], path: str):
        """A body sent with another content type than JSON's, or none. curl's `-d` sends
        `application/x-www-form-urlencoded`, and many clients `text/plain` or nothing: such a body that parses as
        JSON is read as JSON, as llama-server and Ollama read it, when the request comes from no web page (no `Origin`
        header: a browser sends these two types to another origin without a CORS preflight, and they must not
        let a page drive the API). Anything else is refused in the route's own error shape, naming the content
        type (400 on OpenAI's and Anthropic's routes, 422 on the native ones), before the route reads it."""
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        named = repr(media) if media else "missing"
        hint = "send the JSON with the header 'content-type: application/json' (curl: -H 'content-type: application/json')"
        if not _has_route(scope):   # no such route (or not for this method): its 404 or 405, not a body error
            return await self.app(scope, receive, send)
        if media not in LENIENT_TYPES or "origin" in headers:
            return await errors.send_error(send, APIError(
                422, f"the request body must be JSON, sent with content-type: application/json; this request's "
                     f"content-type is {named}" + (" from a web page (Origin header)" if media in LENIENT_TYPES
                                                  else "") + f": {hint}", code="invalid_content_type"), path)
        chunks = []
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return   # the client left
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
        except HTTPException as exc:   # over the body limit while reading a chunked body
            return await errors.send_error(send, APIError(exc.status_code, exc.detail, code="request_too_large"), path)
        body = b"".join(chunks)
        try:
            json.loads(body)
        except (ValueError, RecursionError):   # (not UTF-8, not JSON, nested too deeply)
            return await errors.send_error(send, APIError(
                422, f"the request body is not JSON (its content-type is {named}): {hint}", code="invalid_json"), path)
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"] + \
            [(b"content-type", b"application/json")]   # (in place: the access log reads the route from this scope)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


BODY_METHODS = {"POST", "PUT", "PATCH"}
LENIENT_TYPES = {"application/x-www-form-urlencoded", "text/plain", ""}   # curl -d's, fetch's, none at all


def _has_route(scope) -> bool:
    from starlette.routing import Match

    return any(route.matches(scope)[0] == Match.FULL for route in scope["app"].routes)


def _is_json(content_type: str | None) -> bool:
    """JSON's content type (`application/json`, `application/*+json`): FastAPI reads only such a body as JSON."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def create_app(settings: Settings | None = None, *, loader=None, worker_factory=None,
               metrics: Metrics | None = None) -> FastAPI:
    """The app. `worker_factory(settings, metrics)` replaces the in-process `EngineWorker` (scale-out: a
    worker that forwards planned requests to engine replicas); `metrics` what `/metrics` renders."""
    settings = settings or Settings.from_env()
    metrics = metrics or Metrics()
    # the models served (server/models.py): one, as before, or several, each with its own worker once loaded
    state = build_pool(settings, metrics, worker_factory or (lambda s, m: EngineWorker(s, m, loader=loader)))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        for w in settings.warnings:
            log.warning(w)
        # anyio's thread backend imported and its first worker thread started now, not by the first request (every
        # route tokenizes off the event loop): ~15 ms of CPU the first request after a restart paid
        await anyio.to_thread.run_sync(lambda: None)
        yield
        state.stop()

    app = FastAPI(title="TinyLoop", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tl = state
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(lmstudio.router)
    app.include_router(anthropic.router)   # Anthropic's Messages API (/v1/messages)
    app.include_router(openai_responses.router)   # OpenAI's Responses API (/v1/responses)
    app.include_router(embeddings.router)   # OpenAI's embeddings (/v1/embeddings), on the same engine core
    app.include_router(native.router)
    app.include_router(cache_routes.router)   # saved conversations in the prompt cache on disk (/v1/cache/...)
    app.include_router(playground.router)
    app.include_router(docs_ui.router)   # /docs with Swagger UI's files served from here (no CDN)

    @app.get("/health")
    async def health():
        if not state.single:   # several models: the server serves while any may load; each one's state
            return {"status": "ok", "version": __version__, "commit": settings.commit,
                    "models": {e.name: state.status(e) for e in state.entries}, **state.pool_status()}
        worker = state.worker
        base: dict[str, Any] = {"model": state.model_path, "model_id": state.model_id, "version": __version__, "commit": settings.commit,
                                "kv_cache_mode": settings.kv_cache_mode, "warnings": worker.warnings}
        if worker.state == "unloaded" or (worker.state == "loading" and state.default.on_demand):
            # (keep_alive ran out: it loads again on the next request, which waits for it)
            return {"status": "ok", **base, "model_state": worker.state}
        if worker.state == "ready":
            engine = worker.engine
            out = {"status": "ok", **base, "kv_cache_mode": engine.kv_format,
                   "kv_cache_mode_requested": settings.kv_cache_mode, "max_seq_len": engine.max_seq_len,
                   "executor": engine.executor_name, **worker.health()}
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

    app.add_middleware(LeaseMiddleware)   # a request holds its model until its response has gone out
    app.add_middleware(GateMiddleware, settings=settings, metrics=metrics)
    access.install_cors(app, settings.cors_origins)
    app.add_middleware(access.AccessMiddleware)
    server_openapi.install(app, state)
    return app


UVICORN_STARTUP = ("Started server process", "Waiting for application startup", "Application startup complete",
                   "Uvicorn running on")   # uvicorn's own start-up lines: `serve`'s one line says it all


class _QuietStartup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(UVICORN_STARTUP)


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def loaded_line(engine, model_id: str, url: str) -> str:
    """The one line `tinyloop serve` prints once it serves: the model, its size, depth, context, weights,
    who runs its decode steps (the native executor's ISA, or torch) and where."""
    cfg, params = engine.config, held_params(engine.loaded.header, engine.loaded.index)
    return (f"serving {model_id} ({_params(params)} parameters; loops {cfg.default_loops} default, "
            f"{cfg.max_loops} max; context {engine.max_seq_len} tokens; weights {weights_format(engine.loaded.header)}; "
            f"executor {engine.executor_name}) on {url} from {engine.loaded.path}")


def several_line(pool, url: str) -> str:
    """`tinyloop serve A B ...`'s line: the models, and how they load."""
    bounds = [f"at most {pool.max_loaded} loaded"] if pool.max_loaded is not None else []
    if pool.max_memory is not None:
        bounds.append(f"a memory budget of {pool.max_memory >> 20} MiB")
    return (f"serving {len(pool.entries)} models ({', '.join(e.name for e in pool.entries)}) on {url}; each loads on "
            f"its first request{' (' + ', '.join(bounds) + ')' if bounds else ''}; GET /v1/models or `tinyloop ps` "
            "shows which are loaded")


def load_failure_line(path: str, exc: BaseException | None, reason: str | None) -> str:
    """One line naming the model file and why it did not load."""
    if isinstance(exc, ModelFileError):   # it names the file itself
        why = str(exc)
    else:
        why = f"{path}: {type(exc).__name__ + ': ' if exc is not None else ''}{reason or 'unknown error'}"
    return "tinyloop: error: cannot load the model: " + " ".join(why.split())


def _check_listen(host: str, port: int) -> None:
    """Raise OSError now when host:port cannot be bound (in use, no such address), before a long model load."""
    import socket

    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds it
        sock.bind(addr)


def serve(settings: Settings, *, host: str, port: int, log_level: str = "info") -> int:
    """Run the app under uvicorn; returns the exit status. The model is loaded first (in the engine thread, as
    the in-process app loads it), and only then is the port bound, as vLLM does: a model that cannot be loaded
    ends the command at once with one line on stderr naming the file and why (status 1), never a server that
    answers 503; a good load prints one line (`loaded_line`: model, parameters, loops, context, weights,
    executor, address). On SIGINT/SIGTERM the engine stops taking requests at once and gives in-flight ones
    `shutdown_grace_s` to finish (then fails them with an error event), while uvicorn waits for their
    connections to close."""
    import uvicorn

    try:
        _check_listen(host, port)
    except OSError as exc:
        print(f"tinyloop: error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    access.setup_logging(settings.log_format, log_level)
    app = create_app(settings, worker_factory=lambda s, m: EngineWorker(s, m, log_load_failure=False))
    state = app.state.tl
    state.preload()   # one model: loaded now; several: the pinned ones begin loading, the others load on demand
    if state.single:
        worker = state.worker
        while not worker.ready.wait(0.25):   # (a wait with a timeout: Ctrl-C still interrupts it)
            pass
        if worker.state != "ready":
            print(load_failure_line(state.model_path, worker.load_exception, worker.error), file=sys.stderr)
            worker.stop()
            return 1

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.begin_shutdown()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:   # bound: the address as bound (--port 0: the port the system chose)
                bound = self.servers[0].sockets[0].getsockname()
                where = f"[{host}]" if ":" in host else host
                url = f"http://{where}:{bound[1]}"
                if state.single:
                    log.info(loaded_line(state.worker.engine, state.model_id, url))
                else:
                    log.info(several_line(state, url))

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,  # ours has ids
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5)
    logging.getLogger("uvicorn.error").addFilter(_QuietStartup())
    Server(config).run()
    return 0
