"""The path every generating route shares: validate and tokenize off the event loop, queue to the engine
owner, then either collect the whole result or stream it as SSE (keepalives while the engine is busy,
abort on disconnect).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from ..version import __version__
from ..engine import SamplingParams
from ..errors import ValidationError
from .access import LOOPS_HEADER, SCHEMA_CHECK_HEADER, WARNING_HEADER, add_completion_tokens, note, response_headers
from .knobs import LOOPS_SUFFIX
from .errors import APIError, from_engine_failure
from .sse import DONE, Framer, usage
from .worker import EngineWorker, RequestHandle

FIRST_EVENT_GRACE_S = 0.5   # wait this long for the first event before committing to a 200 stream
DISCONNECT_POLL_S = 0.25    # non-streaming requests check for a vanished client this often
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_NOT_YET = object()


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict[str, Any]
    logprobs: list | None = None   # per token (engine shape), when the request asked for them
    prompt_logprobs: list | None = None   # per prompt token (the first None), with prompt_logprobs
    stop_logprob: tuple | None = None     # (stop id, entry) when a stop token ended it, with logprobs
    stop_sequence: str | None = None      # the stop string that ended it, if one did


DEFAULT_NAME = "tinyloop"   # what the README's examples send


def served_names(given: list[str], path) -> list[str]:
    """The names a request's `model` may use, the id (`/v1/models`) first: `--served-model-name`'s, else the
    file's stem, "tinyloop", and its path (with and without the leading '/')."""
    if given:
        return list(dict.fromkeys(given))
    path = str(path)
    stem = path.rsplit("/", 1)[-1].removesuffix(".tinyloop")
    return list(dict.fromkeys([stem, DEFAULT_NAME, path, path.lstrip("/")]))


class ServerState:
    """What routes need: the settings, the engine worker, metrics and the model's identity (`names`: the
    names requests may use; the first is its id)."""

    def __init__(self, settings, worker: EngineWorker, metrics, names: list[str], created: int):
        self.settings, self.worker, self.metrics = settings, worker, metrics
        self.names, self.created = names, created

    @property
    def model_id(self) -> str:
        return self.names[0]

    def check_model(self, name: str) -> None:
        """A request's `model`: with one model served, any string (echoed into the response; the seed API's
        rule: clients that hard-code a model name work). Under `--strict-model-names` it must be one of this
        server's names (a `@loops=K` suffix aside), else 404 `model_not_found`, as vLLM and OpenAI answer."""
        if not self.settings.strict_model_names:
            return
        if LOOPS_SUFFIX.sub("", name) not in self.names:
            shown = ", ".join(repr(n) for n in self.names[:2])
            raise APIError(404, f"model {name!r} not found; this server serves {shown} (GET /v1/models)",
                           param="model", code="model_not_found")

    def model_info(self) -> dict[str, Any]:
        info = self.worker.require_engine().model_info()  # quant from the file header; kv mode as served
        if info.get("kv_cache_mode") != self.settings.kv_cache_mode:
            info["kv_cache_mode_requested"] = self.settings.kv_cache_mode
        return info

    def runtime(self) -> dict[str, Any]:
        return {"name": "tinyloop", "version": __version__, "commit": self.settings.commit}

    def lmstudio_extras(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {"stats": stats, "model_info": self.model_info(), "runtime": self.runtime()}

    # -- running a request ----------------------------------------------------------------------
    async def submit(self, prompt: str | list[int], params: SamplingParams, *, n: int = 1,
                     timeout_s: float | None = None, max_tokens_given: bool = True) -> RequestHandle:
        """Every check (model-dependent ones too) before queueing; tokenizing runs off the event loop.
        A request that names no max_tokens gets the default, lowered to the server's TINYLOOP_MAX_TOKENS."""
        engine = self.worker.require_engine()
        limit = self.settings.max_tokens
        if not max_tokens_given and params.max_tokens > limit:
            params = params.replace(max_tokens=limit)
        if params.max_tokens > limit:
            raise ValidationError(f"max_tokens: must be at most {limit} on this server (TINYLOOP_MAX_TOKENS), "
                                  f"got {params.max_tokens}", param="max_tokens")

        def prepare():
            return engine.plan(engine.encode_prompt(prompt), params, n=n)

        plan = await anyio.to_thread.run_sync(prepare)
        if plan.warnings:   # a schema the grammar holds only in part: said before any answer goes out
            response_headers()[WARNING_HEADER] = " | ".join(plan.warnings)
        note(mode=plan.mode, loops=plan.loops, n=plan.n, prompt_tokens=plan.n_prompt, max_tokens=plan.max_tokens)
        # the depth it runs at (the one reasoning_effort picked, if it did), before any answer goes out: streams too
        response_headers()[LOOPS_HEADER] = f"auto (max {plan.loops})" if plan.params.adaptive else str(plan.loops)
        handle = self.worker.submit(plan, timeout_s=timeout_s)
        handle.client_timeout = timeout_s is not None   # its expiry is then the client's 408, not a 504
        return handle


async def gather(handle: RequestHandle, request: Request, take: Callable[[Any], Any], what: str) -> Any:
    """Read a non-streamed request's events, each handed to `take`, until `take` returns its result (the
    request is then delivered); abort the request if the client goes away meanwhile or anything fails.
    `what`: the request's kind, for the error when the engine ends it early."""
    done = False
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while True:
            if time.monotonic() >= next_check:  # tokens may arrive faster than the poll: check by the clock
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise APIError(499, "client closed the request", code="client_closed")
            try:
                item = await handle.next(DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if isinstance(item, BaseException):
                done = True
                raise from_engine_failure(item, handle)
            if item is None:
                done = True
                raise APIError(500, f"the engine ended {what}", code="engine_error")
            out = take(item)
            if out is not None:
                done = handle.delivered = True
                return out
    finally:
        if not done:
            handle.abort()


async def collect(handle: RequestHandle, request: Request) -> list[Result]:
    """Wait for a whole generation (every one of its `n` choices, in index order); abort it if the client
    goes away meanwhile."""
    toks: dict[int, list[int]] = {}
    parts: dict[int, list[str]] = {}
    lps: dict[int, list] = {}
    scores: dict[int, list] = {}
    results: dict[int, Result] = {}

    def take(item) -> list[Result] | None:
        toks.setdefault(item.index, []).extend(item.token_ids)
        parts.setdefault(item.index, []).append(item.text)
        lps.setdefault(item.index, []).extend(item.logprobs or [])
        if item.prompt_logprobs is not None:
            scores[item.index] = item.prompt_logprobs
        if item.finish_reason is not None:
            results[item.index] = Result(toks.get(item.index, []), "".join(parts.get(item.index, [])),
                                         item.finish_reason, item.stats or {},
                                         lps.get(item.index) if handle.plan.params.logprobs is not None else None,
                                         scores.get(item.index), item.stop_logprob, item.stop_sequence)
        return [results[i] for i in range(handle.plan.n)] if len(results) == handle.plan.n else None

    out = await gather(handle, request, take, "a request without a result")
    add_completion_tokens(sum(r.stats.get("completion_tokens", 0) for r in out))
    schema_checked(out)
    note(finish_reason=out[0].finish_reason)  # a batch of prompts: its requests' sum
    return out


def state_of(request: Request) -> ServerState:
    """The server's state, as a route reaches it."""
    return request.app.state.tl


def schema_checked(results: list[Result]) -> None:
    """The x-tinyloop-schema-check header of a non-streamed response whose schema was checked after
    generation: "passed", or "failed: " and why, per choice that failed (a streamed choice carries its
    outcome on its final chunk)."""
    checks = [(i, r.stats.get("schema_check")) for i, r in enumerate(results)]
    failed = [f"choice {i}: {c.removeprefix('failed: ')}" for i, c in checks if c and c.startswith("failed")]
    headers = response_headers()
    if failed:
        before = headers.get(SCHEMA_CHECK_HEADER, "")
        head = before + "; " if before.startswith("failed") else "failed: "
        headers[SCHEMA_CHECK_HEADER] = head + "; ".join(failed)
    elif any(c for _, c in checks):
        headers.setdefault(SCHEMA_CHECK_HEADER, "passed")


async def collect_all(handles: list[RequestHandle], request: Request) -> list[list[Result]]:
    """`collect` for several requests at once (a batch of prompts); the first failure aborts the others."""
    tasks = [asyncio.ensure_future(collect(h, request)) for h in handles]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.abort()
        raise


class MergedHandle:
    """Several requests read as one stream (a /v1/completions batch of prompts): the events of request i
    have their choice index moved up by i * n; it ends when all have ended, or with the first failure.
    Reads like a `RequestHandle` for `stream` (next, ready_now, abort, delivered)."""

    def __init__(self, handles: list[RequestHandle], n: int):
        self.handles, self.n = handles, n
        self.delivered = False
        self.client_timeout = any(getattr(h, "client_timeout", False) for h in handles)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(handles)
        self._tasks = [asyncio.ensure_future(self._pump(i, h)) for i, h in enumerate(handles)]

    async def _pump(self, i: int, handle: RequestHandle) -> None:
        while True:
            item = await handle.next()
            if item is None:
                self._open -= 1
                if self._open == 0:
                    self._queue.put_nowait(None)
                return
            if not isinstance(item, BaseException):
                item.index += i * self.n
            self._queue.put_nowait(item)
            if isinstance(item, BaseException):  # the response fails: the other prompts' work is wasted
                self.abort()
                return

    async def next(self, timeout: float | None = None):
        return await asyncio.wait_for(self._queue.get(), timeout)

    def ready_now(self) -> list:
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    def abort(self) -> None:
        me = asyncio.current_task()
        for t in self._tasks:
            if t is not me:
                t.cancel()
        for h in self.handles:
            h.abort()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "delivered" and value:
            for h in self.handles:
                h.delivered = True


def total_usage(results: list[Result]) -> dict[str, int]:
    """One prompt, n completions: prompt tokens counted once (the prefill is shared)."""
    p = results[0].stats["prompt_tokens"]
    c = sum(r.stats["completion_tokens"] for r in results)
    return usage(p, c, results[0].stats.get("prompt_tokens_cached", 0),
                 sum(r.stats.get("reasoning_tokens", 0) for r in results))


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a batch of prompts: every count summed (nested details too)."""
    def add(a: Any, b: Any) -> Any:
        return {k: add(a[k], b[k]) for k in a} if isinstance(a, dict) else a + b
    out = usages[0]
    for u in usages[1:]:
        out = add(out, u)
    return out


async def stream(handle: RequestHandle, framer: Framer, keepalive_s: float):
    """An SSE response for `handle`. Errors that come before the first token are real HTTP errors."""
    first: Any = _NOT_YET
    try:
        first = await handle.next(min(keepalive_s, FIRST_EVENT_GRACE_S))
    except asyncio.TimeoutError:
        pass
    except BaseException:
        handle.abort()
        raise
    if isinstance(first, BaseException):
        raise from_engine_failure(first, handle)

    def frames_for(item) -> tuple[list[bytes], bool]:
        """SSE frames for one worker item, and whether the stream ends with it."""
        if item is None:  # ended without a final event: should not happen, but never hang
            return [DONE], True
        if isinstance(item, BaseException):
            return framer.fail(from_engine_failure(item, handle)), True
        if item.finish_reason is not None:
            return framer.close(item), framer.done
        return framer.event(item), False

    async def body():
        finished = False
        pending = first
        try:
            opening = framer.open()
            if opening:
                yield b"".join(opening)
            while not finished:
                if pending is not _NOT_YET:
                    items, pending = [pending], _NOT_YET
                else:
                    try:
                        items = [await handle.next(keepalive_s)]
                    except asyncio.TimeoutError:
                        yield framer.keepalive  # the engine is still busy (queue wait or a long prefill)
                        continue
                items += handle.ready_now()  # whatever else is ready goes out in the same write
                out: list[bytes] = []
                for item in items:
                    frames, finished = frames_for(item)
                    out += frames
                    if finished:
                        break
                if out:
                    yield b"".join(out)
        finally:
            note(stream=True, completion_tokens=sum(st.get("completion_tokens", 0) for st in framer.closed.values()))
            if finished:
                handle.delivered = True
            else:  # client went away (task cancelled) or the response was dropped
                note(aborted=True)
                handle.abort()

    return EngineStreamResponse(body(), handle, media_type="text/event-stream", headers=SSE_HEADERS)


class EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that aborts its request however the response ends early: even when the client
    leaves before the body iterator ever started (then the iterator's own `finally` never runs)."""

    def __init__(self, content, handle: RequestHandle, **kw):
        super().__init__(content, **kw)
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.handle.delivered:
                self.handle.abort()
