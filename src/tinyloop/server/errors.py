"""Every error leaves the server as OpenAI's shape: {"error": {"message", "type", "param", "code"}}, plus
`request_id` (the `X-Request-Id` of the response), except under the paths of an API with its own error
shape (`register_shape`: Anthropic's Messages API under /v1/messages, server/anthropic/routes.py).

`APIError` is what route code raises; the handlers below turn it, the engine's `ValidationError`,
pydantic's validation errors, Starlette's HTTP errors and anything unexpected into that shape, so no
client ever sees a bare stack trace.
"""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RequestTimeout, ValidationError
from .fields import UNION_TAGS, field_error, param_of

log = logging.getLogger("tinyloop.server")
# the request being answered (X-Request-Id: server/access.py sets it), named in every error body and log line
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tinyloop_request_id", default=None)

# status -> OpenAI error type
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 501: "not_implemented_error", 503: "server_error",
         504: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None,
               request_id: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, plus the id of the request it answers (the current one unless given)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code,
                      "request_id": request_id or request_id_var.get()}}


class ErrorShape(Protocol):
    """How the errors of one API look (its paths registered with `register_shape`)."""

    def status(self, err: APIError) -> int: ...               # the HTTP status it answers `err` with

    def body(self, err: APIError) -> dict[str, Any]: ...      # its JSON body

    def from_pydantic(self, errors: list[dict[str, Any]]) -> APIError: ...   # a malformed body


_SHAPES: list[tuple[str, ErrorShape]] = []


def register_shape(prefix: str, shape: ErrorShape) -> None:
    """Errors of requests whose path is `prefix` or under it (`prefix/...`) take `shape`."""
    _SHAPES[:] = [(p, s) for p, s in _SHAPES if p != prefix] + [(prefix, shape)]


def shape_for(path: str | None) -> ErrorShape | None:
    for prefix, shape in _SHAPES:
        if path is not None and (path == prefix or path.startswith(prefix + "/")):
            return shape
    return None


def shaped(err: APIError, path: str | None) -> tuple[int, dict[str, Any]]:
    """(status, body) of `err` answering a request for `path`."""
    shape = shape_for(path)
    return (err.status, err.body()) if shape is None else (shape.status(err), shape.body(err))


async def send_error(send, err: APIError, path: str | None = None) -> None:
    """An error response straight onto an ASGI `send` (for middleware, outside FastAPI's handlers)."""
    status, obj = shaped(err, path)
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def from_validation(exc: ValidationError) -> APIError:
    return APIError(400, exc.message, param=exc.param, code=exc.code or "invalid_value")


def from_engine_failure(exc: BaseException, handle: Any = None) -> APIError:
    """Map an exception raised while the engine ran a request. A request whose own `timeout_s` ran out
    before it started is answered 408 (the client chose the limit: a 4xx); the server's default limit
    (TINYLOOP_REQUEST_TIMEOUT_S) running out is the server's 504."""
    client = getattr(handle, "client_timeout", False)
    if isinstance(exc, APIError):   # (scale-out: a replica's 504 for a limit the client set is the client's 408)
        if client and exc.status == 504 and exc.code == "timeout":
            return APIError(408, f"{exc.message} (the request's own timeout_s)", param="timeout_s", code="timeout")
        return exc
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    if isinstance(exc, RequestTimeout):
        if client:
            return APIError(408, f"{exc} (the request's own timeout_s)", param="timeout_s", code="timeout")
        return APIError(504, str(exc), code="timeout")
    if isinstance(exc, NotImplementedError):
        return APIError(501, str(exc) or "not implemented in this build", code="not_implemented")
    return APIError(500, f"the engine failed on this request: {type(exc).__name__}: {exc}",
                    code="engine_error")


def error_response(err: APIError, path: str | None = None) -> JSONResponse:
    status, body = shaped(err, path)
    return JSONResponse(body, status_code=status, headers=err.headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    """pydantic's error location as the field's name (`messages[0].role`): union members' tags (`str`,
    `list[int]`, ...) are left out."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    parts = [p for p in parts if p not in UNION_TAGS and "[" not in p and "(" not in p]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def pydantic_error(errs: list[dict[str, Any]], status: int = 422) -> APIError:
    """A malformed body (pydantic's errors) as one error naming the first bad field (`messages[0].role`).
    At 422 (the native routes) the code is `invalid_type`; at 400 (OpenAI's routes) it says what is wrong:
    `missing_required_parameter`, `unknown_parameter`, `invalid_type`, `invalid_value` or `invalid_json`."""
    first = errs[0] if errs else {"loc": ("body",), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = f"{param}: {first.get('msg', 'invalid')}"
    kind = first.get("type", "")
    code = "invalid_type" if status == 422 else _CODES.get(kind) or \
        ("invalid_type" if kind.endswith("_type") else "invalid_value")
    if kind == "json_invalid":
        param, msg = None, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        code = "invalid_type" if status == 422 else "invalid_json"
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return APIError(status, msg, param=param, code=code)


class OpenAIErrors:
    """ErrorShape of OpenAI's chat and text completion routes (/v1 and their /api/v0 mirrors): OpenAI's error
    body, and a malformed body (a missing `model`, `messages: null`, a wrong `response_format.type`) a 400
    naming the field, as OpenAI and vLLM answer (the openai SDK raises BadRequestError for it, another class
    for a 422). The native routes keep 422."""

    @staticmethod
    def status(err: APIError) -> int:
        return 400 if err.status == 422 else err.status

    @staticmethod
    def body(err: APIError) -> dict[str, Any]:
        return err.body()

    @staticmethod
    def from_pydantic(errors: list[dict[str, Any]]) -> APIError:
        return pydantic_error(errors, 400)


class OpenAIFieldErrors(OpenAIErrors):
    """OpenAI's shape for the routes translated onto the chat route's plan (Responses, embeddings): a malformed
    body is a 400 naming the field, its name read from pydantic's location as the Messages API reads it
    (fields.param_of), with OpenAI's codes; an unknown field's message says what the route takes (TAKES).
    A route whose schema tags its unions rewrites the locations first (`locations`)."""

    TAKES = "its documented fields"
    CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}

    @staticmethod
    def locations(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return errors

    @classmethod
    def from_pydantic(cls, errors: list[dict[str, Any]]) -> APIError:
        errors = cls.locations(errors)
        param, message = field_error(errors)   # the field's name and message, read from pydantic's errors
        if param is None:   # not JSON at all
            return APIError(400, message, code="invalid_json")
        kinds = [e.get("type", "") for e in errors if param_of(e.get("loc", ())) == param]
        code = next((cls.CODES[k] for k in kinds if k in cls.CODES), None) or \
            ("invalid_type" if any(k.endswith("_type") for k in kinds) else "invalid_value")
        if code == "unknown_parameter":
            message = f"{param}: unknown parameter; this route takes {cls.TAKES}"
        return APIError(400, message, param=param, code=code)


OPENAI_BODY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/api/v0/chat/completions", "/api/v0/completions")
for _route in OPENAI_BODY_ROUTES:
    register_shape(_route, OpenAIErrors)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return error_response(from_validation(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _pydantic(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        shape = shape_for(request.url.path)
        if shape is not None:
            return error_response(shape.from_pydantic(list(errs)), request.url.path)
        return error_response(pydantic_error(list(errs)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":
            # FastAPI's answer to a body json.loads cannot take (not UTF-8, nested too deeply): the same
            # error as any other malformed JSON
            bad = shape_for(path) is not None
            return error_response(APIError(422, "request body is not valid JSON: not UTF-8, or nested too deeply",
                                           code="invalid_json" if bad else "invalid_type"), path)
        return error_response(APIError(exc.status_code, detail, code=codes.get(exc.status_code),
                                       headers=getattr(exc, "headers", None)), path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"),
                              request.url.path)
