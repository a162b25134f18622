"""LM Studio-style routes (/api/v0/*): the /v1 shapes plus generation-mode knobs on the request and
`stats`, `model_info` and `runtime` on the response (in a stream: on the chunk that carries
`finish_reason`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..generation import ServerState
from .routes import completion_routes, model_routes
from .schemas import LMStudioChatRequest, LMStudioCompletionRequest

router = APIRouter()


def lmstudio_model(state: ServerState) -> dict[str, Any]:
    info = state.model_info()
    return {"id": state.model_id, "object": "model", "type": "llm", "publisher": "tinyloop",
            "arch": info["arch"], "compatibility_type": "tinyloop", "quantization": info["quant"],
            "state": "loaded", "max_context_length": state.worker.require_engine().max_seq_len,
            "model_info": info, "runtime": state.runtime()}


model_routes(router, "/api/v0", lmstudio_model)
completion_routes(router, "/api/v0", LMStudioChatRequest, LMStudioCompletionRequest, extended=True)
