"""OpenAI's embeddings route: `POST /v1/embeddings` (docs/embeddings.md).

A thin translation onto the engine core: the body is checked and tokenized into one embedding plan
(`Engine.plan_embedding`: every input of the request, the depth and the pooling), queued to the engine
owner as any request is (`EngineWorker.submit`: the same queue, limits, timeouts and abort on disconnect),
and run by the same continuous batch as generation (engine/embedding.py): each input prefills at the
request's `loops` and ends with its pooled state. What comes back is encoded as OpenAI encodes it: a list
of floats, or (`encoding_format: "base64"`, what the openai SDK sends by default) the little-endian float32
bytes in base64; `dimensions` keeps the first d components, re-normalized.

TinyLoop's fields: `loops` (the state after that many loops; a model name ending in `@loops=K` asks for K
too) and `pooling` ("mean", the default, or "last"); the response says both (`loops`, `pooling`).

Errors take OpenAI's shape; a malformed body (a wrong type, an unknown or missing field) is a 400 naming the
field, as OpenAI answers (no 422 here).
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ...engine.embedding import check_dimensions, to_base64, truncate
from ...errors import ValidationError
from ..access import note
from ..errors import OpenAIFieldErrors, register_shape
from ..generation import gather
from ..generation import state_of
from ...engine.knobs import KEEP_ALIVE_DOC, Int, KeepAlive, check_timeout
from ..knobs import requested_loops

router = APIRouter()
PATH = "/v1/embeddings"


class EmbeddingsErrors(OpenAIFieldErrors):
    """errors.ErrorShape of this route: OpenAI's error body; a malformed body is a 400 naming the field."""

    TAKES = ("OpenAI's embeddings fields (model, input, encoding_format, dimensions, user) and TinyLoop's loops, "
             "pooling and timeout_s")


register_shape(PATH, EmbeddingsErrors)


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, plus TinyLoop's `loops`, `pooling` and `timeout_s`. `input`, `loops` and
    `pooling` are taken as any JSON value and checked by the engine (a 400 naming the field either way)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="one of the server's model names, echoed into the response")
    input: Any = Field(description="a string, a list of strings, a list of token ids, or a list of token-id lists; "
                                   "none empty, each within the context length")
    encoding_format: Any = Field(None, description='"float" (the default) or "base64" (little-endian float32)')
    dimensions: Int | None = Field(None, description="keep the first d components, re-normalized (1..the model's "
                                                     "width)")
    user: str | None = Field(None, description="accepted; no effect")
    loops: Any = Field(None, description="TinyLoop: the state after this many loops (1..max_loops; default the "
                                         "model's default_loops)")
    pooling: Any = Field(None, description='TinyLoop: "mean" (the default: the mean over the input\'s positions) '
                                           'or "last" (the last position); L2-normalized either way')
    timeout_s: float | None = Field(None, description="TinyLoop: fail if not started within this many seconds")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)

    def requested_loops(self) -> Any:
        return requested_loops(self.loops, self.model)

    def encoding(self) -> str:
        fmt = "float" if self.encoding_format is None else self.encoding_format
        if fmt not in ("float", "base64"):
            raise ValidationError(f'encoding_format: must be "float" or "base64", got {fmt!r}', param="encoding_format")
        return fmt


async def collect_vectors(handle, request: Request) -> list:
    """Wait for every input's vector (in input order); abort the request if the client goes away meanwhile."""
    vectors: dict[int, Any] = {}

    def take(item) -> list | None:
        if item.embedding is not None:
            vectors[item.index] = item.embedding
        return [vectors[i] for i in range(handle.plan.n)] if len(vectors) == handle.plan.n else None

    return await gather(handle, request, take, "an embedding request without its vectors")


@router.post(PATH, include_in_schema=False)
async def embeddings(body: EmbeddingRequest, request: Request):
    check_timeout(body.timeout_s)
    state = await state_of(request).model(body.model, body.timeout_s, body.keep_alive)
    fmt = body.encoding()
    loops = body.requested_loops()
    engine = state.worker.require_engine()
    dimensions = check_dimensions(body.dimensions, engine.config.dim)
    plan = await anyio.to_thread.run_sync(lambda: engine.plan_embedding(body.input, loops=loops, pooling=body.pooling))
    note(mode="embedding", loops=plan.loops, n=plan.n, prompt_tokens=plan.n_prompt)
    handle = state.worker.submit(plan, timeout_s=body.timeout_s)
    handle.client_timeout = body.timeout_s is not None   # its expiry is then the client's 408, not a 504
    vectors = await collect_vectors(handle, request)
    data = []
    for i, v in enumerate(vectors):
        v = truncate(v, dimensions)
        data.append({"object": "embedding", "index": i, "embedding": to_base64(v) if fmt == "base64" else v.tolist()})
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": plan.n_prompt, "total_tokens": plan.n_prompt},
                         "loops": plan.loops, "pooling": plan.pooling})
