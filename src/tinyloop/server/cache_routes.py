"""Saved conversations in the prompt cache on disk (`--prompt-cache-dir`; engine/disk_cache.py, engine/cache_dir.py): llama-server's
`/slots/{id}?action=save|restore`, in this server's own shape.

    POST   /v1/cache/save     {"name", "prompt" | "messages", "loops"?}  the prompt's KV kept on disk under `name`
    POST   /v1/cache/restore  {"name"}                                   read back into the prefix cache
    GET    /v1/cache                                                     the saved names
    DELETE /v1/cache/{name}

A save runs the prompt through the engine (one greedy token; a prefix already cached, in memory or on disk,
is not computed again), then the engine writes its full blocks' files, if not there already, and
`saved/<name>.json` naming them; saved blocks are the last the byte bound evicts. A restore plans the saved
tokens again: their blocks come back from disk into memory, and a later request that starts with them
computes only the rest (`usage.prompt_tokens_details.cached_tokens`). The same block files back both, and the
prompt cache's lazy reads after a restart. A name is 1 to 128 letters, digits, '.', '_' or '-', not starting
with '.' or '-', without '..': never a path, so it cannot leave the cache directory.

The routes are left out of /openapi.json (the schema fuzzer's operation count); docs/server.md documents them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ..engine import SamplingParams
from ..engine.cache_dir import CacheNameError, check_name, file_hash, list_manifests, read_manifest, saved_path
from .errors import APIError
from .generation import collect
from .generation import state_of
from .knobs import ChatMessage, render_chat

router = APIRouter()
MANIFEST_WAIT_S = 60.0   # how long a save waits for the engine's writer to put the manifest on disk


class CacheSaveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(description="the saved conversation's name: 1 to 128 letters, digits, '.', '_' or '-'")
    prompt: str | list[int] | None = Field(None, description="text or token ids (or give messages)")
    messages: list[ChatMessage] | None = Field(None, description="a conversation, rendered as the chat route does")
    loops: int | None = Field(None, description="the depth its KV is computed at (default: the model's); a later "
                                                "request reuses it at the same depth")
    model: str | None = None
    timeout_s: float | None = None


class CacheRestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    model: str | None = None
    timeout_s: float | None = None


async def _root(request: Request, model: str | None = None, timeout_s: float | None = None):
    """(the model's state, the cache directory); `model`: several served, which one (default the first)."""
    pool = state_of(request)
    state = pool if model is None and pool.single else await pool.model(model, timeout_s)
    root = state.settings.prompt_cache_dir
    if root is None:
        raise APIError(501, "the prompt cache on disk is off: start the server with --prompt-cache-dir DIR "
                            "(TINYLOOP_PROMPT_CACHE_DIR)", code="prompt_cache_off")
    disk = getattr(state.worker, "prompt_cache", False)
    if disk is None and state.worker.state == "ready":   # in process, and its directory could not be used
        raise APIError(503, f"the prompt cache directory {root} could not be used (see the server's warnings)",
                       code="prompt_cache_unavailable")
    return state, root


def _name(name: str) -> str:
    try:
        return check_name(name)
    except CacheNameError as exc:
        raise APIError(400, str(exc), param="name", code="invalid_cache_name") from None


async def _run(request: Request, state, ids: list[int], loops: int | None, window: int, name: str | None,
               timeout_s: float | None) -> dict[str, Any]:
    engine = state.worker.require_engine()
    params = SamplingParams(max_tokens=1, temperature=0, loops=loops, cache_window=window)

    def prepare():
        return engine.plan(engine.encode_prompt(ids), params)

    plan = await anyio.to_thread.run_sync(prepare)
    if name is not None:
        plan = dataclasses.replace(plan, cache_save=name)
    handle = state.worker.submit(plan, timeout_s=timeout_s)
    result = (await collect(handle, request))[0]
    return {"plan": plan, "stats": result.stats}


@router.post("/v1/cache/save", include_in_schema=False)
async def save(body: CacheSaveRequest, request: Request):
    state, root = await _root(request, body.model, body.timeout_s)
    name = _name(body.name)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt", code="invalid_value")
    engine = state.worker.require_engine()
    if body.messages is not None:
        chat = render_chat(body.messages, getattr(engine.tokenizer, "chat_template", None))
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, chat)
    else:
        ids = await anyio.to_thread.run_sync(engine.encode_prompt, body.prompt)
    path = saved_path(root, name)
    started = time.time()
    ran = await _run(request, state, ids, body.loops, 0, name, body.timeout_s)
    manifest = await _wait_manifest(path, started, ids)
    if manifest is None:
        raise APIError(503, f"the engine did not write {name!r} within {MANIFEST_WAIT_S:g} s; retry",
                       code="prompt_cache_unavailable")
    return {"object": "prompt_cache.saved", "name": name, "prompt_tokens": len(ids),
            "cached_tokens": ran["stats"].get("prompt_tokens_cached", 0),
            "saved_tokens": manifest.get("cached_tokens", 0), "bytes": manifest.get("bytes", 0),
            "loops": manifest.get("loops"), "created": int(manifest.get("created", started))}


async def _wait_manifest(path, started: float, ids: list[int]) -> dict[str, Any] | None:
    """The manifest the engine's writer puts on disk after the save's blocks (this save's: not an older one)."""
    deadline = time.monotonic() + MANIFEST_WAIT_S
    delay = 0.002
    while time.monotonic() < deadline:
        try:
            m = json.loads(path.read_text())
            if isinstance(m, dict) and m.get("created", 0) >= started - 1 and m.get("tokens") == ids:
                return m
        except (OSError, ValueError):
            pass
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
    return None


@router.post("/v1/cache/restore", include_in_schema=False)
async def restore(body: CacheRestoreRequest, request: Request):
    state, root = await _root(request, body.model, body.timeout_s)
    name = _name(body.name)
    manifest = await anyio.to_thread.run_sync(read_manifest, root, name)
    if manifest is None:
        raise APIError(404, f"no saved conversation {name!r} (GET /v1/cache lists them)", param="name",
                       code="cache_not_found")
    disk = getattr(state.worker, "prompt_cache", None)
    ident = manifest.get("identity") or {}
    if disk is not None:   # in process: the engine's whole identity (model, KV format, executor, ...)
        if ident != disk.identity:
            diff = sorted(k for k in set(ident) | set(disk.identity) if ident.get(k) != disk.identity.get(k))
            raise APIError(409, f"{name!r} was saved by another model or engine set-up ({', '.join(diff)} differ)",
                           param="name", code="cache_mismatch")
    else:   # scale-out: the model file's hash (the replicas check the rest on every block they read)
        model_hash = await anyio.to_thread.run_sync(file_hash, state.model_path, root)
        if ident.get("model") != model_hash:
            raise APIError(409, f"{name!r} was saved for another model", param="name", code="cache_mismatch")
    ids = manifest.get("tokens")
    if not isinstance(ids, list) or not ids:
        raise APIError(409, f"{name!r} has no tokens", param="name", code="cache_mismatch")
    ran = await _run(request, state, ids, manifest.get("loops"), manifest.get("window") or 0, None, body.timeout_s)
    restored = ran["stats"].get("prompt_tokens_cached", 0)
    saved = manifest.get("cached_tokens", 0)
    try:
        path = saved_path(root, name)
        await anyio.to_thread.run_sync(lambda: path.touch(exist_ok=True))
    except OSError:
        pass
    return {"object": "prompt_cache.restored", "name": name, "prompt_tokens": len(ids), "saved_tokens": saved,
            "restored_tokens": restored, "complete": restored >= saved, "loops": manifest.get("loops")}


def _entry(m: dict[str, Any]) -> dict[str, Any]:
    return {"name": m.get("name"), "prompt_tokens": len(m.get("tokens") or []),
            "saved_tokens": m.get("cached_tokens", 0), "bytes": m.get("bytes", 0), "loops": m.get("loops"), "created": int(m.get("created", 0)),
            "model_sha256": (m.get("identity") or {}).get("model")}


@router.get("/v1/cache", include_in_schema=False)
async def list_saved(request: Request):
    state, root = await _root(request)
    saved = await anyio.to_thread.run_sync(list_manifests, root)
    disk = getattr(state.worker, "prompt_cache", None)
    return {"object": "list", "data": [_entry(m) for m in saved],
            "disk_bytes": disk.bytes_on_disk if disk is not None else None}


@router.delete("/v1/cache/{name}", include_in_schema=False)
async def delete_saved(name: str, request: Request):
    _, root = await _root(request)
    name = _name(name)
    path = saved_path(root, name)
    try:
        await anyio.to_thread.run_sync(path.unlink)
    except FileNotFoundError:
        raise APIError(404, f"no saved conversation {name!r}", param="name", code="cache_not_found") from None
    return {"object": "prompt_cache.deleted", "name": name, "deleted": True}
