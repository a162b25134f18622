"""Request ids, access logs and CORS.

Every request gets an id: the client's `X-Request-Id` when it sent a sane one (1-128 characters of
`[A-Za-z0-9._:-]`), else a generated `req-<24 hex>`. It goes back in the `X-Request-Id` header of every
response, into every log line written while the request runs (and the engine thread's lines about it),
and into every error body (`error.request_id`).

One access-log line per request (logger `tinyloop.access`, level INFO): method, route, status, duration,
prompt and completion tokens, loops, mode, n, stream. `TINYLOOP_LOG_FORMAT=json` writes every line as one
JSON object. Request headers (API keys included) and bodies are never logged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import sys
import time
from typing import Any

from .errors import APIError, request_id_var, send_error, shape_for

REQUEST_ID_HEADER = "X-Request-Id"
WARNING_HEADER = "x-tinyloop-warning"            # schema parts not enforced exactly (docs/structured.md)
SCHEMA_CHECK_HEADER = "x-tinyloop-schema-check"  # the complete answers' check against such a schema
LOOPS_HEADER = "x-tinyloop-loops"                # the depth a generating request runs at (its plan's)
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
access_var: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("tinyloop_access", default=None)
# headers a route adds to its response (structured output's x-tinyloop-warning, x-tinyloop-schema-check)
headers_var: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("tinyloop_headers", default=None)
access_log = logging.getLogger("tinyloop.access")
log = logging.getLogger("tinyloop.server")


def new_request_id() -> str:
    return f"req-{secrets.token_hex(12)}"


def note(**fields: Any) -> None:
    """Add fields (tokens, loops, mode, ...) to the current request's access-log line."""
    info = access_var.get()
    if info is not None:
        info.update(fields)


def response_headers() -> dict[str, str]:
    """The current request's extra response headers (name -> value), to add to or read; sent with the
    response's start (a stream's: before its first event)."""
    headers = headers_var.get()
    return headers if headers is not None else {}


def _header_value(value: str) -> bytes:
    """A header value from text that may hold a client's names: one line of ASCII, at most 2,000 bytes."""
    flat = " ".join(value.split()).encode("ascii", "backslashreplace")
    return flat if len(flat) <= 2000 else flat[:1997] + b"..."


def add_completion_tokens(count: int) -> None:
    info = access_var.get()
    if info is not None:
        info["completion_tokens"] = info.get("completion_tokens", 0) + count


class AccessMiddleware:
    """Outermost middleware: the request id, the access-log line, and a last-resort 500 (OpenAI-shaped, or in
    the shape of the API under the path: errors.shape_for) for an exception nothing else handled (so even that
    response carries the id)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), "")
        rid = given if _VALID_ID.fullmatch(given) else new_request_id()
        request_id_var.set(rid)
        info: dict[str, Any] = {}
        access_var.set(info)
        extra: dict[str, str] = {}
        headers_var.set(extra)
        started = {"status": None}
        t0 = time.perf_counter()
        # Anthropic's clients read the id from `request-id` (their API's header): sent too on its paths
        names = (b"x-request-id", b"request-id") if shape_for(scope.get("path")) is not None else (b"x-request-id",)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                started["status"] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                headers += [(k.lower().encode(), _header_value(v)) for k, v in extra.items()]
                message = {**message, "headers": [*headers, *((name, rid.encode()) for name in names)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - the last resort: never a bare stack trace to the client
            log.exception("unhandled error")
            if started["status"] is None:
                await send_error(send_with_id, APIError(500, f"internal error: {type(exc).__name__}",
                                                        code="internal_error"), scope.get("path"))
        finally:
            fields = {"method": scope.get("method"), "route": route_label(scope, scope.get("path")),
                      "status": started["status"], "duration_ms": round((time.perf_counter() - t0) * 1000, 2),
                      **info}
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(" ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
                                extra={"access": fields})


def route_label(scope, unmatched: str | None = "unmatched") -> str | None:
    """The route a request matched, as its path template (`/v1/models/{model_id:path}`), for metrics and the
    access log: FastAPI's API routes put themselves in the scope; Starlette's own (`/openapi.json`) do not,
    so they are matched here. `unmatched` for a path no route serves (metrics: "unmatched", bounded label
    values; the access log: the path itself)."""
    route = scope.get("route")
    if route is None:
        from starlette.routing import Match

        for candidate in getattr(scope.get("app"), "routes", ()):
            if candidate.matches(scope)[0] == Match.FULL:
                route = candidate
                break
    return getattr(route, "path", None) or unmatched


class RequestIdFilter(logging.Filter):
    """Puts `request_id` on every record: the one given in `extra`, else the current request's, else '-'."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = request_id_var.get() or "-"
        return True


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                               "request_id": getattr(record, "request_id", None), "message": record.getMessage()}
        out.update(getattr(record, "access", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(log_format: str = "text", level: str = "info", stream=None) -> logging.Handler:
    """One handler on the `tinyloop` logger: text (`time level [request id] message`) or JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JSONFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger("tinyloop")
    for old in [h for h in root.handlers if getattr(h, "_tinyloop", False)]:
        root.removeHandler(old)
    handler._tinyloop = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.propagate = False
    return handler


def install_cors(app, origins: list[str]) -> None:
    """CORS is off unless TINYLOOP_CORS_ORIGINS names origins ("*" for any): browsers on other origins
    then may call the API (with the API key, if one is set: preflights need none)."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["Authorization", "x-api-key", "anthropic-version", "Content-Type",
                                      REQUEST_ID_HEADER],
                       expose_headers=[REQUEST_ID_HEADER, "request-id", WARNING_HEADER, SCHEMA_CHECK_HEADER,
                                       LOOPS_HEADER], max_age=600)
