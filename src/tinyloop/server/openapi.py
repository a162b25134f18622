"""The OpenAPI document at /openapi.json: what every route really takes and really returns.

FastAPI writes the request schemas from the pydantic models (knobs.py and each API's schemas.py: strict types, and the engine's
ranges as JSON-schema keywords). This module adds what FastAPI cannot know:

- the limits that depend on the served model or the settings (`x-limit` markers: `max_tokens`,
  `max_loops`, the last token id) and the model ids `/v1/models/{id}` answers for;
- every response: the JSON bodies (response_models.py), the SSE content type of streaming routes, the
  `text/plain` of /metrics, each error status with OpenAI's error body, and the `X-Request-Id` header.

Rules JSON Schema cannot state (prompt_tokens + max_tokens within the context, draft_loops below
verify_loops, K_branches x draft_ahead <= 64, stream_options only when streaming) are written in the
descriptions and surface as 400s naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import response_models as R
from .access import LOOPS_HEADER, REQUEST_ID_HEADER, SCHEMA_CHECK_HEADER, WARNING_HEADER

ERROR_TEXT = {
    400: "invalid value (out of range, over the context length or KV capacity, conflicting fields); on OpenAI's "
         "routes a malformed body too (wrong types, missing or unknown fields, invalid JSON: no 422 there)",
    401: "API key missing or wrong (when TINYLOOP_API_KEY is set)",
    404: "no such model (/v1/models/{id}; under --strict-model-names, a request's `model` the server does not "
         "serve: code model_not_found)",
    408: "the request's own timeout_s ran out while it was still queued",
    413: "request body over TINYLOOP_MAX_BODY_BYTES",
    422: "malformed body: wrong types, missing or unknown fields, invalid JSON",
    429: "the queue is full (TINYLOOP_MAX_QUEUE); see Retry-After",
    500: "the engine failed on this request",
    501: "not implemented in this build",
    503: "the model is loading or failed to load, or the server is shutting down",
    504: "the server's default time limit (TINYLOOP_REQUEST_TIMEOUT_S) ran out while the request was still queued",
}
GENERATE_ERRORS = (400, 401, 408, 413, 422, 429, 500, 501, 503, 504)
OPENAI_ERRORS = (*(s for s in GENERATE_ERRORS if s != 422), 404)   # a malformed body is a 400 (errors.OpenAIErrors)
TOKEN_ERRORS = (400, 401, 413, 422, 503)

CHAT_SSE = (R.ChatChunk, "chat.completion.chunk events")
TEXT_SSE = (R.TextChunk, "text_completion chunk events")
V0 = "; the chunk with finish_reason carries stats, model_info and runtime"
NATIVE_SSE = (R.NativeEvent, "one {token_id, text} event per token, then {token_id: -1, text, finish_reason, stats}")

# path -> (method, 200 body model, (SSE event model, description) or None, error statuses)
ROUTES: dict[str, tuple[str, type[BaseModel] | None, tuple[type[BaseModel], str] | None, tuple[int, ...]]] = {
    "/v1/chat/completions": ("post", R.ChatCompletion, CHAT_SSE, OPENAI_ERRORS),
    "/v1/completions": ("post", R.Completion, TEXT_SSE, OPENAI_ERRORS),
    "/api/v0/chat/completions": ("post", R.LMStudioChatCompletion, (CHAT_SSE[0], CHAT_SSE[1] + V0), OPENAI_ERRORS),
    "/api/v0/completions": ("post", R.LMStudioCompletion, (TEXT_SSE[0], TEXT_SSE[1] + V0), OPENAI_ERRORS),
    "/generate": ("post", R.GenerateResponse, NATIVE_SSE, GENERATE_ERRORS),
    "/generate/speculative": ("post", R.GenerateResponse, NATIVE_SSE, GENERATE_ERRORS),
    "/generate/tree_speculative": ("post", R.GenerateResponse, NATIVE_SSE, GENERATE_ERRORS),
    "/tokenize": ("post", R.TokenizeResponse, None, TOKEN_ERRORS),
    "/detokenize": ("post", R.DetokenizeResponse, None, TOKEN_ERRORS),
    "/tokenizer_info": ("get", R.TokenizerInfo, None, (400, 401, 503)),
    "/v1/models": ("get", R.ModelList, None, (401, 503)),
    "/v1/models/{model_id}": ("get", R.ModelCard, None, (401, 404, 503)),
    "/api/v0/models": ("get", R.LMStudioModelList, None, (401, 503)),
    "/api/v0/models/{model_id}": ("get", R.LMStudioModel, None, (401, 404, 503)),
    "/health": ("get", R.HealthOK, None, ()),
    "/metrics": ("get", None, None, (401,)),
}
# One working request per body (schemathesis's examples phase sends them; clients can copy them).
_CHAT = {"model": "tinyloop", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 8,
         "temperature": 0, "stop": ["\nUser:"]}
_TEXT = {"model": "tinyloop", "prompt": "The king said", "max_tokens": 8, "temperature": 0, "loops": 4}
_NATIVE = {"prompt": "The king said", "max_tokens": 8, "loops": 4}
EXAMPLES = {
    "ChatCompletionRequest": _CHAT, "CompletionRequest": _TEXT,
    "LMStudioChatRequest": {**_CHAT, "mode": "speculative", "draft_loops": 1, "verify_loops": 4},
    "LMStudioCompletionRequest": {**_TEXT, "mode": "tree_speculative", "draft_loops": 1, "verify_loops": 4,
                                  "K_branches": 2, "draft_ahead": 2},
    "GenerateRequest": _NATIVE, "SpeculativeRequest": {**_NATIVE, "draft_loops": 1, "verify_loops": 4},
    "TreeSpeculativeRequest": {**_NATIVE, "draft_loops": 1, "verify_loops": 4, "K_branches": 2, "draft_ahead": 2},
    "TokenizeRequest": {"text": "The king said"}, "DetokenizeRequest": {"tokens": [464, 5822, 531]},
}

DOC_MODELS = [R.ErrorResponse, R.HealthDown, R.ChatChunk, R.TextChunk, R.NativeEvent,
              *{m for _, m, _, _ in ROUTES.values() if m is not None}]


def limits_of(state) -> dict[str, Any] | None:
    """The served model's limits, or None while it is not loaded (the document is then not cached)."""
    worker = state.worker
    if worker.state != "ready":
        return None
    cfg = worker.engine.config
    return {"max_tokens": state.settings.max_tokens, "max_loops": cfg.max_loops, "vocab_max": cfg.vocab_size - 1,
            "model_ids": list(state.names), "model_names": model_name_pattern(state)}


def model_name_pattern(state) -> str | None:
    """The `model` a request may name under --strict-model-names: one of the server's names, with an optional
    `@loops=K` suffix. None (any string) otherwise."""
    if not state.settings.strict_model_names:
        return None
    return "^(" + "|".join(re.escape(n) for n in state.names) + ")(@loops=(auto|-?[0-9]+))?$"


def _fill_limits(node: Any, limits: dict[str, Any]) -> None:
    if isinstance(node, dict):
        if node.pop("x-model-names", None) and limits["model_names"] is not None:
            node["pattern"] = limits["model_names"]
        name = node.pop("x-limit", None)
        if name is not None:
            node["maximum"] = limits[name]
            if isinstance(node.get("default"), int) and node["default"] > limits[name]:
                node["default"] = limits[name]  # a default over the server's limit is lowered to it
        for v in node.values():
            _fill_limits(v, limits)
    elif isinstance(node, list):
        for v in node:
            _fill_limits(v, limits)


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


SCHEMA_HEADERS = {  # generating routes: a JSON schema held in part (docs/structured.md, "Schema coverage"); the depth
    WARNING_HEADER: {"description": "the schema keywords not enforced while generating and the formats written as "
                     "plain strings, each with its JSON path", "schema": {"type": "string"}},
    SCHEMA_CHECK_HEADER: {"description": "non-streamed, under a schema with such keywords: \"passed\", or "
                          "\"failed: \" and why (each answer validated against the schema as sent)",
                          "schema": {"type": "string"}},
    LOOPS_HEADER: {"description": "the depth the request runs at: its loops, the one its reasoning_effort picked "
                   "on a model with a trained range, or the model's default; \"auto (max K)\" under loops \"auto\"",
                   "schema": {"type": "string"}}}


def build_openapi(app, state, default_limits: dict[str, Any]) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=__doc__.split("\n\n")[0],
                      routes=app.routes)
    limits = limits_of(state) or default_limits
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "serialization") for m in DOC_MODELS],
                                 ref_template="#/components/schemas/{model}")
    comps.update(defs.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    header = {REQUEST_ID_HEADER: {"description": "the request's id: the client's own if it sent one, else "
                                  "generated; also in every log line and in error bodies",
                                  "schema": {"type": "string"}, "required": True}}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            spec = ROUTES.get(path)
            if spec is None or spec[0] != method:
                for resp in op.get("responses", {}).values():
                    resp.setdefault("headers", {}).update(header)
                continue
            _, model, sse, errors = spec
            if path == "/metrics":
                ok = {"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}}
            else:
                ok = _json(model.__name__)
            if sse:
                ok["text/event-stream"] = {"schema": R.sse_event_schema(sse[0].__name__, sse[1])}
            out = {"200": {"description": "OK", "content": ok, "headers": {**header, **(SCHEMA_HEADERS if sse else {})}}}
            for status in errors:
                out[str(status)] = {"description": ERROR_TEXT[status], "content": _json("ErrorResponse"),
                                    "headers": header}
            if path == "/health":
                out["503"] = {"description": "the model is loading or failed to load (the reason says why)",
                              "content": _json("HealthDown"), "headers": header}
            op["responses"] = out
            for param in op.get("parameters", []):
                if param["name"] == "model_id":
                    param["schema"] = {"type": "string", "enum": limits["model_ids"]}
                    param["description"] = "one of the server's model names (--served-model-name; by default the "\
                                           "file's stem, \"tinyloop\" and its path)"
    for name, example in EXAMPLES.items():
        if name in comps:
            comps[name]["examples"] = [example]
    _fill_limits(doc, limits)
    return doc


def install(app, state) -> None:
    """Serve the document built above (cached once the model is loaded: the limits are then final)."""
    defaults = {"max_tokens": state.settings.max_tokens, "max_loops": 64, "vocab_max": 50256,
                "model_ids": list(state.names), "model_names": model_name_pattern(state)}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build_openapi(app, state, defaults)
        if limits_of(state) is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi
