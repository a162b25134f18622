"""The engine owner: one thread owns the model and its KV memory; requests reach it through a queue.

The HTTP side talks to it through two calls only, which a continuous-batching scheduler can keep:

    handle = worker.submit(prompt_ids, params)   # validated already; raises APIError 503/429
    item = await handle.next(timeout)            # StreamEvent | Exception; None once finished
    handle.abort()                               # client went away: stop and free the KV cache

Each request's events go to its own asyncio queue via `loop.call_soon_threadsafe`, so nothing blocks
the event loop. An aborted request is noticed between two tokens (or skipped if still queued); closing
its stream generator frees its KV cache at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import Engine, SamplingParams, StreamEvent
from ..errors import ValidationError
from .errors import APIError
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("tinyloop.server")
_ids = itertools.count(1)


@dataclass
class RequestHandle:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _abort: threading.Event = field(default_factory=threading.Event)
    finished: bool = False       # the HTTP side has read the end of the request's events
    delivered: bool = False      # the HTTP side has handed the final result to its client

    # -- HTTP side (event loop) ----------------------------------------------------------------
    async def next(self, timeout: float | None = None) -> StreamEvent | BaseException | None:
        """The next item: a StreamEvent, an exception (the request failed) or None (finished).

        Raises asyncio.TimeoutError when nothing came within `timeout` seconds (the caller may send a
        keepalive and wait again)."""
        if self.finished and self._events.empty():
            return None
        if not self._events.empty():  # the common case while decoding: no timer, no task
            item = self._events.get_nowait()
        else:
            item = await asyncio.wait_for(self._events.get(), timeout)
        if item is None:
            self.finished = True
        return item

    def ready_now(self) -> list[StreamEvent | BaseException | None]:
        """Everything already queued, without waiting (lets a stream send several events in one write)."""
        out = []
        while not self._events.empty():
            item = self._events.get_nowait()
            out.append(item)
            if item is None:
                self.finished = True
                break
        return out

    def abort(self) -> None:
        self._abort.set()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    # -- engine side (worker thread) ------------------------------------------------------------
    def _put(self, item: StreamEvent | BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # event loop closed (server shutting down): nobody is listening
            self._abort.set()


class EngineWorker:
    """Loads the engine in its own thread, then runs queued requests one at a time."""

    def __init__(self, settings: Settings, metrics: Metrics,
                 loader: Callable[[Settings], tuple[Engine, list[str]]] | None = None):
        self.settings = settings
        self.metrics = metrics
        self.loader = loader or load_engine
        self.engine: Engine | None = None
        self.state = "loading"                # loading | ready | failed
        self.error: str | None = None         # why the engine is not ready
        self.warnings: list[str] = list(settings.warnings)
        self.ready = threading.Event()        # set once loading ended, either way
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tinyloop-engine", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def require_engine(self) -> Engine:
        if self.engine is not None and self.state == "ready":
            return self.engine
        if self.state == "loading":
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})
        raise APIError(503, f"the engine is not loaded: {self.error}", code="model_not_loaded")

    # -- the HTTP side's interface ----------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a validated request. Must be called from the event loop that will read the handle."""
        self.require_engine()
        with self._lock:
            if self._waiting >= self.settings.max_queue:
                raise APIError(429, f"the request queue is full ({self.settings.max_queue} waiting); retry later",
                               code="queue_full", headers={"Retry-After": "1"})
            self._waiting += 1
        self.metrics.queue_depth.set(self._waiting)
        handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop())
        self._queue.put(handle)
        return handle

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine, warnings = self.loader(self.settings)
            self.warnings += warnings
            self.state = "ready"
            self.metrics.engine_loaded.set(1)
        except Exception as exc:  # noqa: BLE001 - the server stays up and reports why
            self.state, self.error = "failed", str(exc) or type(exc).__name__
            log.error("engine failed to load: %s", self.error)
        finally:
            self.ready.set()
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            with self._lock:
                self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)
            self._serve(handle)

    def _serve(self, handle: RequestHandle) -> None:
        m = self.metrics
        handle.started = time.perf_counter()
        m.queue_wait.observe(handle.started - handle.submitted)
        if handle.aborted:  # the client left while queued
            m.aborted.inc()
            return
        m.active.inc()
        n_tokens = 0
        try:
            stream = self.engine.stream(handle.prompt_ids, handle.params)
            try:
                for ev in stream:
                    if n_tokens == 0 and ev.token_ids:
                        m.ttft.observe(time.perf_counter() - handle.submitted)
                    n_tokens += len(ev.token_ids)
                    if ev.finish_reason is not None:
                        self._account(ev.stats or {}, ev.finish_reason, handle)
                    handle._put(ev)
                    if ev.finish_reason is None and handle.aborted:
                        m.aborted.inc()
                        m.prompt_tokens.inc(len(handle.prompt_ids))
                        m.generated_tokens.inc(n_tokens)
                        break
            finally:
                stream.close()  # frees the request's KV cache now, not at garbage collection
            if not handle.aborted:
                handle._put(None)
        except Exception as exc:  # noqa: BLE001 - reported to the request, the worker keeps serving
            if not isinstance(exc, (NotImplementedError, ValidationError)):
                log.exception("request %d failed in the engine", handle.id)
            m.failed.inc()
            handle._put(exc)
            handle._put(None)
        finally:
            m.active.dec()
            m.generation_seconds.observe(time.perf_counter() - handle.started)

    def _account(self, stats: dict[str, Any], finish: str, handle: RequestHandle) -> None:
        self.metrics.prompt_tokens.inc(stats.get("prompt_tokens", len(handle.prompt_ids)))
        self.metrics.generated_tokens.inc(stats.get("completion_tokens", 0))
        self.metrics.generations.labels(finish).inc()


def load_engine(settings: Settings) -> tuple[Engine, list[str]]:
    """Load the model file and pick the KV format: the requested one if the engine supports it.

    Returns (engine, warnings). A KV mode the engine or its cache rejects is reported and fp16 is used."""
    from ..engine.generate import new_cache
    from ..modelfile import load_model

    from ..model.fast import prepare_for_decode

    loaded = load_model(settings.model_path)
    prepare_for_decode(loaded.model)  # fused projections, fp16 FBGEMM for 16-bit weights (docs/decode.md)
    kv = settings.kv_cache_mode
    if kv != "fp16":
        try:
            engine = Engine(loaded, max_seq_len=settings.max_seq_len, kv_format=kv)
            new_cache(loaded.model, 1, 1, 0, kv_format=kv)  # the cache is where a format is finally built
            return engine, []
        except Exception as exc:  # noqa: BLE001 - ValidationError / CacheError / an unknown format
            msg = getattr(exc, "message", None) or str(exc)
            warning = f"KV cache mode {kv!r} was requested but the engine rejected it ({msg}); serving with 'fp16'"
            return Engine(loaded, max_seq_len=settings.max_seq_len, kv_format="fp16"), [warning]
    return Engine(loaded, max_seq_len=settings.max_seq_len, kv_format=kv), []
