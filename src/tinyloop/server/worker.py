"""The engine owner: one thread owns the model and its KV memory; requests reach it through a queue.

The HTTP side talks to it through three calls:

    handle = worker.submit(plan)                     # an Engine.plan (checked); raises APIError 503/429
    item = await handle.next(timeout)                # StreamEvent | Exception; None once finished
    handle.abort()                                   # client went away: stop and free its KV pages

The thread runs a continuous batch (`engine.serving.BatchEngine`): every iteration takes in the
requests that arrived, drops the aborted ones (their KV pages go back to the pool at once) and runs one
batched step for everything in flight. Each request's events go to its own asyncio queue via
`loop.call_soon_threadsafe`, so nothing blocks the event loop. Past `max_queue` requests waiting for
their first token, `submit` answers 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..engine import Engine, RequestPlan, StreamEvent
from ..engine.disk_cache import open_prompt_cache
from ..engine.requests import Request
from ..engine.serving import BatchEngine
from ..errors import ValidationError
from .access import request_id_var
from .errors import APIError
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("tinyloop.server")
_ids = itertools.count(1)


@dataclass
class RequestHandle:
    plan: RequestPlan
    loop: asyncio.AbstractEventLoop
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when it got into the running batch
    got_token: bool = False
    _events: collections.deque = field(default_factory=collections.deque)
    _waiter: asyncio.Future | None = None   # the reader's future while it waits for an event
    _abort: threading.Event = field(default_factory=threading.Event)
    timeout_s: float | None = None
    client_timeout: bool = False  # timeout_s is the request's own (its expiry is a 408), not the server's default
    finished: bool = False       # the HTTP side has read the end of the request's events
    request_id: str | None = field(default_factory=request_id_var.get)  # X-Request-Id, for the engine's logs
    delivered: bool = False      # the HTTP side has handed the final result to its client

    # -- HTTP side (event loop) ----------------------------------------------------------------
    async def next(self, timeout: float | None = None) -> StreamEvent | BaseException | None:
        """The next item: a StreamEvent, an exception (the request failed) or None (finished).

        Raises asyncio.TimeoutError when nothing came within `timeout` seconds (the caller may send a
        keepalive and wait again)."""
        if self.finished and not self._events:
            return None
        if not self._events:  # wait on a bare future (no task per event; a timer only with a timeout)
            fut = self._waiter = self.loop.create_future()
            timer = None if timeout is None else self.loop.call_later(timeout, _time_out, fut)
            try:
                await fut
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        item = self._events.popleft()
        if item is None:
            self.finished = True
        return item

    def _push(self, item: Any) -> None:
        """(event loop) Queue an item and wake the reader."""
        self._events.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def ready_now(self) -> list[StreamEvent | BaseException | None]:
        """Everything already queued, without waiting (lets a stream send several events in one write)."""
        out = []
        while self._events:
            item = self._events.popleft()
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
        deliver(self.loop, [(self, item)])


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


def deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestHandle, Any]]) -> None:
    """Hand events to their handles' queues on `loop`: one thread-safe wake-up for the whole list."""
    def put_all() -> None:
        for handle, item in items:
            handle._push(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # event loop closed (server shutting down): nobody is listening
        for handle, _ in items:
            handle._abort.set()


class EngineWorker:
    """Loads the engine in its own thread, then serves every queued request through one `BatchEngine`:
    each loop iteration takes in new requests, drops aborted ones, and runs one batched step."""

    def __init__(self, settings: Settings, metrics: Metrics,
                 loader: Callable[[Settings], tuple[Engine, list[str]]] | None = None, *,
                 log_load_failure: bool = True):
        """`log_load_failure`: log why the model did not load (an in-process server that stays up and says it
        on /health); `tinyloop serve` says it itself, in one line, and exits (app.serve)."""
        self.settings = settings
        self.metrics = metrics
        self.loader = loader or load_engine
        self.engine: Engine | None = None
        self.batch: BatchEngine | None = None
        self.state = "loading"                # loading | ready | failed
        self.error: str | None = None         # why the engine is not ready
        self.load_exception: BaseException | None = None   # what the loader raised, if it failed
        self.log_load_failure = log_load_failure
        self.warnings: list[str] = list(settings.warnings)
        self.ready = threading.Event()        # set once loading ended, either way
        self._inbox: queue.Queue[RequestHandle | None] = queue.Queue()
        self._waiting = 0                     # submitted, not yet in the running batch (inbox + scheduler queue)
        self._lock = threading.Lock()
        self._closing = False
        self._active: dict[int, tuple[RequestHandle, Request]] = {}
        self._outbox: list[tuple[RequestHandle, Any]] = []   # events of this iteration, sent by _flush
        self._flushed_early = False           # this iteration's step flushed before its forward or head
        self._thread = threading.Thread(target=self._run, name="tinyloop-engine", daemon=True)
        self._launched = False
        self.prompt_cache = None              # engine.disk_cache.DiskPrefixCache (--prompt-cache-dir)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> "EngineWorker":
        """Start loading in the engine thread (once: `tinyloop serve` starts it before the app's lifespan does,
        to load the model before the port is bound)."""
        if not self._launched:
            self._launched = True
            self._thread.start()
        return self

    def begin_shutdown(self) -> None:
        """Graceful shutdown starts: new requests get 503; in-flight ones have `settings.shutdown_grace_s`
        to finish, then what is left is failed with a 503 error event (so every stream ends properly)."""
        if not self._closing:
            self._closing = True
            self._inbox.put(None)

    def stop(self) -> None:
        self.begin_shutdown()
        self._thread.join(self.settings.shutdown_grace_s + 5.0)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def require_engine(self) -> Engine:
        if self.engine is not None and self.state == "ready":
            return self.engine
        if self.state == "loading":
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})
        if self.batch is not None:  # it was serving, then its thread failed
            raise APIError(503, self.error or "the engine thread failed", code="engine_failed")
        raise APIError(503, f"the engine is not loaded: {self.error}", code="model_not_loaded")

    def health(self) -> dict[str, Any]:
        """What `/health` adds to its `ok` answer about the engine's load."""
        return {"queue_depth": self.queue_depth}

    # -- the HTTP side's interface ----------------------------------------------------------------
    def check_open(self) -> None:
        """Raise the 503 a new request gets while the engine is not serving or the server shuts down."""
        self.require_engine()
        if self._closing:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           code="shutting_down", headers={"Retry-After": "5"})

    def submit(self, plan: RequestPlan, *, timeout_s: float | None = None) -> RequestHandle:
        """Queue a planned request (`Engine.plan`). Must be called from the event loop that will read the handle."""
        self.check_open()
        with self._lock:
            if self._waiting >= self.settings.max_queue:
                raise APIError(429, f"the request queue is full ({self.settings.max_queue} waiting); retry later",
                               code="queue_full", headers={"Retry-After": "1"})
            self._waiting += 1
        self.metrics.queue_depth.set(self._waiting)
        if timeout_s is None and self.settings.request_timeout_s > 0:
            timeout_s = self.settings.request_timeout_s
        handle = RequestHandle(plan, asyncio.get_running_loop(), timeout_s=timeout_s)
        self._inbox.put(handle)
        return handle

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine, warnings = self.loader(self.settings)
            self.warnings += warnings
            s = self.settings
            def core() -> BatchEngine:
                return BatchEngine(self.engine, max_num_seqs=s.max_num_seqs, max_batched_tokens=s.max_batched_tokens,
                                   kv_pool_bytes=None if s.kv_pool_mb is None else s.kv_pool_mb << 20,
                                   prefix_caching=s.prefix_caching)
            self.batch = core()
            try:   # (one-time costs before the first user's request; a failure here is a request's to report)
                self.batch.warm_up()
            except Exception as exc:  # noqa: BLE001
                log.warning("the engine's warm-up failed (%s: %s); serving without it", type(exc).__name__, exc)
                self.batch = core()   # (nothing of the failed warm-up left in the core)
            self._open_prompt_cache()
            runner = self.batch.runner
            if self.batch.runs_natively:   # the step's forward is one native call without the GIL
                runner.before_forward = self._flush_early
            runner.before_head = self._flush_early
            self.state = "ready"
            self.metrics.engine_loaded.set(1)
        except Exception as exc:  # noqa: BLE001 - the server stays up and reports why
            self.state, self.error, self.load_exception = "failed", str(exc) or type(exc).__name__, exc
            if self.log_load_failure:
                log.error("engine failed to load: %s", self.error)
        finally:
            self.ready.set()
        if self.batch is None:
            while self._inbox.get() is not None:  # nothing is accepted without an engine
                pass
            return
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as exc:  # noqa: BLE001 - the engine thread itself failed: say so, end cleanly
            self._crashed(exc)
        finally:
            if self.prompt_cache is not None:   # what the writer has queued, and what it had no room for
                self.prompt_cache.close(self.batch.sched.prefix, timeout=max(1.0, self.settings.shutdown_grace_s))

    def _open_prompt_cache(self) -> None:
        """`--prompt-cache-dir`: the prefix cache's blocks kept on disk (engine/disk_cache.py). A directory that
        cannot be used is a warning, and the server serves without it."""
        s = self.settings
        if s.prompt_cache_dir is None:
            return
        if self.batch.sched.prefix is None:
            self.warnings.append("TINYLOOP_PROMPT_CACHE_DIR needs prefix caching (TINYLOOP_PREFIX_CACHING=0 turns "
                                 "it off); serving without the prompt cache on disk")
            log.warning(self.warnings[-1])
            return
        try:
            self.prompt_cache = open_prompt_cache(self.batch, self.engine, s.prompt_cache_dir, s.prompt_cache_bytes)
        except Exception as exc:  # noqa: BLE001 - served without it, and said so
            self.warnings.append(f"the prompt cache directory {s.prompt_cache_dir} cannot be used ({exc}); serving "
                                 "without the prompt cache on disk")
            log.warning(self.warnings[-1])
            return
        self.metrics.track_prompt_cache(self.prompt_cache.stats)
        if s.prompt_cache_preload:   # the last conversation back in memory and replayed once, before serving
            try:
                self.prompt_cache.warm_start(self.batch)
            except Exception as exc:  # noqa: BLE001
                log.warning("prompt cache: the warm start failed (%s: %s)", type(exc).__name__, exc)

    def _crashed(self, exc: BaseException) -> None:
        """The engine thread failed outside any one request: /health turns 503 with the reason, every
        in-flight and queued request ends with a 503 error (never a hang), and new ones are refused."""
        log.critical("the engine thread failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self.error = f"the engine thread failed: {type(exc).__name__}: {exc}"
        self.state = "failed"
        self.metrics.engine_loaded.set(0)
        err = APIError(503, self.error, code="engine_failed")
        for handle, _ in list(self._active.values()):
            self._outbox.append((handle, err))
            self._outbox.append((handle, None))
            self._retire(handle)
        self._flush()
        while True:  # until shutdown: what was queued meanwhile gets the same answer
            try:
                handle = self._inbox.get(timeout=0.5)
            except queue.Empty:
                if self._closing:
                    return
                continue
            if handle is None:
                return
            self._dequeued()
            handle._put(err)
            handle._put(None)

    def _serve(self) -> None:
        stop_at: float | None = None
        while True:
            items: list[RequestHandle | None] = []
            idle_wait, disk = 0.5, self.prompt_cache
            if disk is not None and self.settings.prompt_cache_preload and disk.preloading and not self.batch.has_work \
                    and stop_at is None:   # idle after a start: the prompt cache's recent blocks back into memory
                idle_wait = 0.002 if disk.preload(self.batch.sched.prefix) else 0.5
            try:  # wait for work when idle; otherwise take what has arrived and step at once
                items.append(self._inbox.get(timeout=idle_wait) if not self.batch.has_work
                             else self._inbox.get_nowait())
                while True:
                    items.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for handle in items:
                if handle is None:
                    stop_at = time.monotonic() + self.settings.shutdown_grace_s
                else:
                    self._admit(handle)
            self._drop_aborted()
            self._update_gauges()
            if stop_at is not None and (not self.batch.has_work or time.monotonic() >= stop_at):
                self._fail_all(APIError(503, "the server shut down before this request finished",
                                        code="shutting_down"))
                self._flush()
                return
            self._flushed_early = False
            if self.batch.has_work:
                self.batch.step()
            if not self._flushed_early or not self.batch.has_work:
                self._flush()

    def _admit(self, handle: RequestHandle) -> None:
        m = self.metrics
        if handle.aborted:  # the client left while queued
            self._dequeued()
            m.aborted.inc()
            return
        try:
            req = self.batch.add(handle.plan, self._emitter(handle), timeout_s=handle.timeout_s, on_admit=lambda: self._started(handle))
        except Exception as exc:  # noqa: BLE001 - reported to the request
            self._dequeued()
            m.failed.inc()
            handle._put(exc)
            handle._put(None)
            return
        self._active[handle.id] = (handle, req)
        m.active.inc()

    def _emitter(self, handle: RequestHandle) -> Callable[[Any], None]:
        m = self.metrics

        def emit(item: Any) -> None:
            if isinstance(item, StreamEvent):
                if item.token_ids and not handle.got_token:
                    handle.got_token = True
                    m.ttft.observe(time.perf_counter() - handle.submitted)
                if item.embedding is not None:   # an embedding request's input (one per event): its tokens only
                    m.prompt_tokens.inc((item.stats or {}).get("prompt_tokens", 0))
                elif item.finish_reason is not None:
                    stats = item.stats or {}
                    m.generated_tokens.inc(stats.get("completion_tokens", 0))
                    m.generations.labels(item.finish_reason).inc()
                    for loops, count in (stats.get("loops_histogram") or {}).items():
                        for _ in range(count):
                            m.loops_per_token.observe(int(loops))
                    if item.index == 0:
                        m.prompt_tokens.inc(stats.get("prompt_tokens", handle.plan.n_prompt))
                        m.prompt_tokens_cached.inc(stats.get("prompt_tokens_cached", 0))
            elif isinstance(item, BaseException):
                if not isinstance(item, (NotImplementedError, ValidationError, APIError)):
                    log.error("request %d failed in the engine: %s", handle.id, item,
                              extra={"request_id": handle.request_id})
                m.failed.inc()
            elif item is None:
                self._retire(handle)
            self._outbox.append((handle, item))

        return emit

    def _flush_early(self) -> None:
        """The previous step's events go out as this step's first long op without the GIL starts: the
        forward when the native executor runs it (milliseconds, one call), else the LM head (a GEMM of about a
        millisecond). The event loop's work on them then overlaps that op instead of taking the GIL from the
        engine thread in the middle of its Python work (a step that runs neither flushes at its end)."""
        self._flushed_early = True
        self._flush()

    def _flush(self) -> None:
        """Send the events this iteration produced: one wake-up of each event loop per step."""
        if not self._outbox:
            return
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
        for handle, item in self._outbox:
            by_loop.setdefault(id(handle.loop), (handle.loop, []))[1].append((handle, item))
        self._outbox = []
        for loop, items in by_loop.values():
            deliver(loop, items)

    def _started(self, handle: RequestHandle) -> None:
        """The request got into the running batch: it no longer counts against the queue limit."""
        if handle.started is None:
            handle.started = time.perf_counter()
            self._dequeued()
            self.metrics.queue_wait.observe(handle.started - handle.submitted)

    def _retire(self, handle: RequestHandle) -> None:
        if self._active.pop(handle.id, None) is not None:
            self.metrics.active.dec()
            self.metrics.generation_seconds.observe(time.perf_counter() - handle.submitted)
        if handle.started is None:  # ended (aborted, failed, timed out) before it ran
            handle.started = time.perf_counter()
            self._dequeued()

    def _dequeued(self) -> None:
        with self._lock:
            self._waiting -= 1
        self.metrics.queue_depth.set(self._waiting)

    def _drop_aborted(self) -> None:
        for hid, (handle, req) in list(self._active.items()):
            if handle.aborted:
                self.batch.abort(req)
                self.metrics.aborted.inc()
                self._retire(handle)

    def _fail_all(self, err: APIError) -> None:
        for handle, req in list(self._active.values()):
            self.batch.fail(req, err)  # emits the error and the end: _retire runs through the emitter
        while True:
            try:
                handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                self._dequeued()
                handle._put(err)
                handle._put(None)

    def _update_gauges(self) -> None:
        self.metrics.kv_pages_used.set(self.batch.sched.pool.n_pages - self.batch.sched.pool.num_free)
        self.metrics.running.set(self.batch.num_running)


def load_engine(settings: Settings) -> tuple[Engine, list[str]]:
    """`Engine.load` (the one loader) with the KV format the settings ask for, if the engine supports it.

    Returns (engine, warnings). A KV mode the engine rejects is reported and fp16 is used; the model is
    loaded once (in fp16 KV) and re-wrapped for the requested format."""
    engine = Engine.load(settings.model_path, max_seq_len=settings.max_seq_len, kv_format="fp16",
                         draft_exit=settings.draft_exit)
    warnings = []
    if settings.max_seq_len is not None and settings.max_seq_len > engine.config.max_seq_len:
        warnings.append(f"TINYLOOP_MAX_SEQ_LEN={settings.max_seq_len} is above the model's context of "
                        f"{engine.config.max_seq_len} tokens; serving {engine.config.max_seq_len}")
    loops = getattr(settings, "default_loops", None)
    if loops is not None:   # a model's own default depth (a models config's `loops`): read everywhere from its cfg
        cfg = engine.model.cfg
        if 1 <= loops <= cfg.max_loops:
            engine.model.cfg = engine.config = dataclasses.replace(cfg, default_loops=loops)
        else:
            warnings.append(f"loops {loops} is outside the model's 1..{cfg.max_loops}; serving its default "
                            f"{cfg.default_loops}")
    kv = settings.kv_cache_mode
    if kv == "fp16":
        return engine, warnings
    try:
        return Engine(engine.loaded, max_seq_len=settings.max_seq_len, kv_format=kv), warnings
    except ValidationError as exc:
        warning = f"KV cache mode {kv!r} was requested but the engine rejected it ({exc.message}); serving with 'fp16'"
        return engine, warnings + [warning]
