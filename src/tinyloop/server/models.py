"""Several models behind one server (`tinyloop serve A B ...`): the model pool.

A request's `model` picks one (`await state_of(request).model(body.model, timeout_s, keep_alive)`), which
returns that model's `ServerState` (its settings, its own `EngineWorker` and engine core, its names); the
route then runs as it does with one model. What the pool adds:

- **Loaded on demand.** A model loads on its first request (in its own engine thread: the other models keep
  serving); requests for it wait until it is loaded, bounded by their `timeout_s` (else the server's
  `TINYLOOP_REQUEST_TIMEOUT_S`; none: until the load ends).
- **keep_alive** (Ollama's field): after a request ends its model stays for the request's `keep_alive`, else
  the model's (config file), else the server's (`--keep-alive`; default: until it must make room). A number
  of seconds or a duration ("5m", "1h30m", "300ms"); negative pins the model (never unloaded), 0 unloads
  it once its last request has ended.
- **Room**: a load that would pass `--max-loaded-models` or the memory budget (`--max-memory`) first
  unloads the least recently used models that are not pinned. A model chosen to go takes no new requests
  (they wait for its next load) and goes when its last running request ends: an unload never cuts one.
  Unloading stops its engine thread and frees its weights, KV pool, prefix cache and grammars.
- **Failure**: a model whose load fails answers its requests with a 503 naming it and why
  (`model_load_failed`; tried again after `RETRY_FAILED_S`); the others keep serving.

With ONE model served the pool is transparent: the model is loaded at start as before, any `model` string
is accepted unless `--strict-model-names`, and the pool reads as that model's `ServerState` (attributes are
forwarded), so routes and tests that use it as one keep working.

Leases: the pool counts a model's running requests from `model()` until the HTTP exchange ends (the response
sent, a stream's last byte included): `LeaseMiddleware` (installed by `create_app`) releases them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Callable

import anyio

from .errors import APIError
from .generation import DEFAULT_NAME, ServerState, served_names
from .model_memory import estimate_bytes, free, measure_bytes
from .model_specs import default_names, model_settings, offline_card
from .settings import PINNED, parse_keep_alive, show_keep_alive

log = logging.getLogger("tinyloop.server")
RETRY_FAILED_S = 30.0       # a model that failed to load is tried again by a request after this long
REAPER_PERIOD_S = 0.5       # keep_alive expiries are checked this often


# -- leases: a request's hold on its model until its response has gone out ---------------------
_leases: contextvars.ContextVar[list | None] = contextvars.ContextVar("tinyloop_model_leases", default=None)


class LeaseMiddleware:
    """Plain ASGI: the models a request obtained from the pool are released once the app has answered (the
    whole body sent, a stream's too, or the client gone)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: list = []
        token = _leases.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            _leases.reset(token)
            for pool, entry, keep in held:
                pool._release(entry, keep)


# -- the pool ------------------------------------------------------------------------------------
class _Unloaded:
    """The worker of a model that is not loaded (what `pool.worker` reads then)."""

    engine = batch = prompt_cache = load_exception = None
    warnings: list[str] = []

    def __init__(self, name: str, state: str = "unloaded", error: str | None = None):
        self.name, self.state, self.error = name, state, error

    def require_engine(self):
        raise APIError(503, f"model {self.name!r} is not loaded", code="model_not_loaded",
                       headers={"Retry-After": "1"})

    def health(self) -> dict[str, Any]:
        return {}


class ModelEntry:
    """One served model: its settings and names, and while loaded its `ServerState` (worker, engine)."""

    def __init__(self, settings, names: list[str], path: Path, created: int):
        self.settings, self.names, self.path, self.created = settings, names, path, created
        self.served = None                  # ServerState while loading or loaded
        self.running = 0                    # requests holding it (from model() to the end of their response)
        self.waiting = 0                    # requests waiting for it to load
        self.first_wait = math.inf          # when the oldest of them began waiting
        self.last_used = 0.0                # monotonic: LRU order
        self.keep = settings.keep_alive     # the keep_alive in force (the last request's, else the model's)
        self.expires_at: float | None = None
        self.evicting = False               # chosen to go: no new requests, unloaded when the last ends
        self.unloading = False
        self.error: str | None = None       # why its last load failed
        self.failed_at = -math.inf
        self.load_started = 0.0
        self.load_seconds: float | None = None
        self.unload_seconds: float | None = None
        self.memory: int | None = None      # bytes its weights and KV pool hold (measured once loaded)
        self.on_demand = False              # its last load was a request's (not the server's start)
        self.estimate = estimate_bytes(path, settings)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def ready(self) -> bool:
        return self.served is not None and self.served.worker.state == "ready" and not self.unloading

    @property
    def state(self) -> str:
        if self.unloading:
            return "unloading"
        if self.served is None:
            return "failed" if self.error else "unloaded"
        worker_state = self.served.worker.state
        return {"ready": "loaded"}.get(worker_state, worker_state)   # loading | loaded | failed

    @property
    def pinned(self) -> bool:
        return self.settings.keep_alive == PINNED or self.keep == PINNED

    @property
    def holds(self) -> int:
        """Bytes it holds or will hold (measured once loaded, else estimated)."""
        return self.memory if self.memory is not None else self.estimate


class ModelPool:
    """Names -> models; loads on demand, unloads by keep_alive and LRU (module docstring)."""

    def __init__(self, settings, metrics, entries: list[ModelEntry], make_state: Callable[[ModelEntry], Any]):
        self.settings, self.metrics, self.entries = settings, metrics, entries
        self.single = len(entries) == 1
        self._make_state = make_state
        self._by_name: dict[str, ModelEntry] = {}
        for entry in entries:
            for name in entry.names:
                self._by_name.setdefault(name, entry)
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None
        self.max_loaded = settings.max_loaded_models
        self.max_memory = settings.max_memory
        # On Ray Serve (scaleout/app.py) each model's replicas load and go in its own deployment (autoscaled to
        # zero by its keep_alive): this pool, the ingress's, holds every model's planning engine, ignores a
        # request's keep_alive, leaves the model metrics to the workers and shows their state (`model_status`).
        self.replicated = False

    # one model served: the pool reads as its ServerState (routes, openapi, tests)
    def __getattr__(self, name: str):
        entries = self.__dict__.get("entries")
        if not entries or name.startswith("__"):
            raise AttributeError(name)
        entry = entries[0]
        if entry.served is None:
            placeholder = ServerState(entry.settings, _Unloaded(entry.name, entry.state, entry.error),
                                      self.metrics, names=entry.names, created=entry.created)
            placeholder.model_path = str(entry.path)
            return getattr(placeholder, name)
        return getattr(entry.served, name)

    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def all_names(self) -> list[str]:
        return [e.name for e in self.entries]

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, name: str | None) -> ModelEntry:
        """The model a request's `model` names (a `@loops=K` suffix aside; None: the first). One model served:
        any name unless --strict-model-names (ServerState.check_model's rule). Else an unknown name is a 404
        naming it, with the list."""
        if name is None:
            return self.default
        if self.single:
            served = self.default.served
            if served is not None:
                served.check_model(name)
            elif self.settings.strict_model_names and _bare(name) not in self.default.names:
                self._not_found(name)
            return self.default
        entry = self._by_name.get(_bare(name))
        if entry is None:
            self._not_found(name)
        return entry

    def listed(self, model_id: str) -> ModelEntry:
        """`/v1/models/{id}`: the model one of whose names is exactly `model_id`, else a 404 naming the list."""
        for entry in self.entries:
            if model_id in entry.names:
                return entry
        self._not_found(model_id)

    def _not_found(self, name: str):
        shown = ", ".join(repr(e.name) for e in self.entries)
        raise APIError(404, f"model {name!r} not found; this server serves {shown} (GET /v1/models)",
                       param="model", code="model_not_found")

    # -- a request's model ------------------------------------------------------------------------
    async def model(self, name: str | None = None, timeout_s: float | None = None, keep_alive: Any = None):
        """The `ServerState` of the model `name` picks, loaded (waiting for its load, at most `timeout_s`, else
        the server's request timeout); held until this request's response has gone out."""
        entry = self.lookup(name)
        keep = parse_keep_alive(keep_alive)
        if self.replicated:
            keep = None
        if self.single and entry.served is not None and not entry.evicting and not entry.unloading \
                and not (entry.on_demand and entry.served.worker.state == "loading"):
            return self._lease(entry, keep)   # one model: today's path (loading at start: 503 as before)
        limit = timeout_s if timeout_s is not None else (self.settings.request_timeout_s or None)
        deadline = None if limit is None else time.monotonic() + limit
        entry.waiting += 1
        entry.first_wait = min(entry.first_wait, time.monotonic())
        try:
            while not (entry.ready and not entry.evicting):
                if self.single and entry.served is not None and entry.served.worker.state == "failed":
                    break   # (one model that failed to load again: the route answers as at start)
                if entry.served is None and not entry.unloading and entry.error \
                        and time.monotonic() - entry.failed_at < RETRY_FAILED_S:
                    raise APIError(503, f"model {entry.name!r} failed to load: {entry.error}",
                                   code="model_load_failed", headers={"Retry-After": str(int(RETRY_FAILED_S))})
                blocked = self._schedule(entry)
                if blocked:
                    raise APIError(503, blocked, code="model_capacity", headers={"Retry-After": "5"})
                changed = self._event()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._timed_out(entry, limit, timeout_s is not None)
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    raise self._timed_out(entry, limit, timeout_s is not None) from None
        finally:
            entry.waiting -= 1
            if entry.waiting == 0:
                entry.first_wait = math.inf
            self._notify()
        return self._lease(entry, keep)

    def _timed_out(self, entry: ModelEntry, limit: float, client: bool) -> APIError:
        what = f"model {entry.name!r} was not loaded within {limit:g} s ({entry.state})"
        if client:
            return APIError(408, what + " (the request's own timeout_s)", param="timeout_s", code="timeout")
        return APIError(504, what + " (TINYLOOP_REQUEST_TIMEOUT_S)", code="timeout")

    def _lease(self, entry: ModelEntry, keep: float | None):
        entry.running += 1
        entry.last_used = time.monotonic()
        entry.expires_at = None
        if keep is not None:
            entry.keep = keep
        held = _leases.get()
        if held is not None:
            held.append((self, entry, keep))
        else:   # (no middleware: nothing releases it; count it as ended at once)
            entry.running -= 1
        return entry.served

    def _release(self, entry: ModelEntry, keep: float | None) -> None:
        entry.running -= 1
        entry.last_used = time.monotonic()
        entry.keep = keep if keep is not None else entry.settings.keep_alive
        if entry.running == 0 and entry.served is not None and not entry.unloading:
            if entry.evicting:
                self._unload(entry, "lru")
            elif entry.keep is not None and entry.keep != PINNED:
                if entry.keep <= 0:
                    self._unload(entry, "keep_alive")
                else:
                    entry.expires_at = entry.last_used + entry.keep
        self._notify()

    # -- loading and unloading --------------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _occupying(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.served is not None or e.unloading]

    def _schedule(self, wanted: ModelEntry) -> str | None:
        """Start the loads that have room, choosing models to unload for the others. Returns why `wanted`
        can never be loaded now (every model in the way pinned, or over the memory budget alone), else None."""
        why = None
        for entry in sorted((e for e in self.entries if e.waiting and e.served is None and not e.unloading),
                            key=lambda e: e.first_wait):
            if entry.error and time.monotonic() - entry.failed_at < RETRY_FAILED_S:
                continue
            problem = self._make_room(entry)
            if problem is None:
                self._start_load(entry)
            elif problem != "wait" and entry is wanted:
                why = problem
        return why

    def _fits(self, entries: list[ModelEntry], entry: ModelEntry) -> bool:
        if self.max_loaded is not None and len(entries) + 1 > self.max_loaded:
            return False
        return self.max_memory is None or sum(e.holds for e in entries) + entry.holds <= self.max_memory

    def _make_room(self, entry: ModelEntry) -> str | None:
        """None: room now; "wait": models already on their way out will make it; else why there is none."""
        if self.max_memory is not None and entry.holds > self.max_memory:
            return (f"model {entry.name!r} needs about {entry.holds >> 20} MiB, more than the memory budget of "
                    f"{self.max_memory >> 20} MiB (--max-memory)")
        occupying = self._occupying()
        if self._fits(occupying, entry):
            return None
        staying = [e for e in occupying if not (e.evicting or e.unloading)]
        if self._fits(staying, entry):
            return "wait"
        # least recently used first; not one still loading, nor one whose waiting requests are about to run
        candidates = sorted((e for e in staying if e.ready and not e.pinned and not e.waiting),
                            key=lambda e: e.last_used)
        chosen = []
        while candidates and not self._fits(staying, entry):
            victim = candidates.pop(0)
            staying.remove(victim)
            chosen.append(victim)
        if not self._fits(staying, entry):
            if any(not e.pinned for e in staying):   # loading, or about to serve: a candidate once that is done
                return "wait"
            pinned = [e.name for e in staying if e.pinned]
            limit = (f"--max-loaded-models {self.max_loaded}" if self.max_loaded is not None and
                     len(staying) + 1 > self.max_loaded else f"--max-memory {self.max_memory >> 20} MiB")
            return (f"model {entry.name!r} cannot be loaded now: the models loaded fill {limit} and "
                    f"{', '.join(repr(n) for n in pinned)} {'is' if len(pinned) == 1 else 'are'} pinned (keep_alive -1)")
        for victim in chosen:
            victim.evicting = True
            if victim.running == 0:
                self._unload(victim, "lru")
        return "wait"

    def _start_load(self, entry: ModelEntry) -> None:
        entry.served = self._make_state(entry)
        entry.error, entry.on_demand = None, True
        entry.load_started = time.monotonic()
        entry.served.worker.start()
        self._watch(entry)

    def _watch(self, entry: ModelEntry) -> None:
        task = asyncio.ensure_future(self._watch_load(entry, entry.served))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_load(self, entry: ModelEntry, served) -> None:
        worker = served.worker
        await anyio.to_thread.run_sync(worker.ready.wait)
        seconds = time.monotonic() - entry.load_started
        m = self.metrics
        if worker.state == "ready" and self.replicated:   # (the planning engine: its replicas count the loads)
            entry.load_seconds = seconds
        elif worker.state == "ready":
            entry.load_seconds = seconds
            entry.last_used = max(entry.last_used, time.monotonic())
            entry.memory = measure_bytes(worker)
            if entry.keep is not None and entry.keep != PINNED and not entry.running and not entry.waiting:
                entry.expires_at = time.monotonic() + entry.keep   # (loaded at start: its keep_alive runs now)
            m.model_loads.labels(entry.name, "ok").inc()
            m.model_load_seconds.labels(entry.name).observe(seconds)
            m.model_memory.labels(entry.name).set(entry.memory)
            if not self.single:
                log.info("loaded model %s in %.2f s (%d MiB)", entry.name, seconds, entry.memory >> 20)
        else:
            entry.error = worker.error or "unknown error"
            entry.failed_at = time.monotonic()
            m.model_loads.labels(entry.name, "failed").inc()
            if not self.single:   # (one model: it stays as it is, and says why on /health, as before)
                log.error("model %s failed to load: %s", entry.name, entry.error)
                entry.served = None
                await anyio.to_thread.run_sync(worker.stop)
        self._gauges()
        self._notify()

    def _unload(self, entry: ModelEntry, reason: str) -> None:
        entry.unloading, entry.evicting, entry.expires_at = True, False, None
        task = asyncio.ensure_future(self._do_unload(entry, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _do_unload(self, entry: ModelEntry, reason: str) -> None:
        served, began = entry.served, time.monotonic()
        try:
            await anyio.to_thread.run_sync(free, served.worker, self.metrics)
        except Exception as exc:  # noqa: BLE001 - it is gone all the same
            log.warning("model %s: unloading raised %s: %s", entry.name, type(exc).__name__, exc)
        entry.served, entry.unloading, entry.memory = None, False, entry.memory
        entry.unload_seconds = time.monotonic() - began
        self.metrics.model_unloads.labels(entry.name, reason).inc()
        self.metrics.model_unload_seconds.labels(entry.name).observe(entry.unload_seconds)
        self.metrics.model_memory.labels(entry.name).set(0)
        log.info("unloaded model %s (%s) in %.2f s", entry.name, reason, entry.unload_seconds)
        self._gauges()
        self._notify()

    def _gauges(self) -> None:
        if self.replicated:
            return
        loaded = sum(1 for e in self.entries if e.ready)
        self.metrics.models_loaded.set(loaded)
        if not self.single:
            self.metrics.engine_loaded.set(1 if loaded else 0)

    async def _reap(self) -> None:
        """Unload the models whose keep_alive has run out."""
        while True:
            await asyncio.sleep(REAPER_PERIOD_S)
            now = time.monotonic()
            for entry in self.entries:
                if entry.ready and not entry.running and entry.expires_at is not None and now >= entry.expires_at \
                        and not entry.pinned:
                    self._unload(entry, "keep_alive")

    # -- lifecycle --------------------------------------------------------------------------------
    def preload(self) -> None:
        """Models loaded at start: the one model served, else the pinned ones (the rest load on demand). Safe
        to call before an event loop runs (`tinyloop serve` loads before it binds the port)."""
        for entry in self.entries:
            if entry.served is None and (self.single or entry.pinned):
                entry.served = self._make_state(entry)
                entry.load_started = time.monotonic()
            if entry.served is not None:
                entry.served.worker.start()

    def start(self) -> None:
        """(in the event loop) Watch the loads begun by `preload`; check keep_alive expiries."""
        self.preload()
        for entry in self.entries:
            if entry.served is not None:
                self._watch(entry)
        self._reaper = asyncio.ensure_future(self._reap())

    def begin_shutdown(self) -> None:
        for entry in self.entries:
            if entry.served is not None:
                entry.served.worker.begin_shutdown()

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in self.entries:
            if entry.served is not None:
                entry.served.worker.stop()

    # -- what /v1/models and `tinyloop ps` show ---------------------------------------------------
    def status(self, entry: ModelEntry) -> dict[str, Any]:
        """A model's state, memory and keep_alive (the `tinyloop` field of its /v1/models card)."""
        now = time.monotonic()
        out: dict[str, Any] = {"state": entry.state, "memory_bytes": entry.memory if entry.ready else 0,
                               "memory_estimate_bytes": entry.holds, "running": entry.running,
                               "waiting": entry.waiting, "pinned": entry.pinned,
                               "keep_alive": show_keep_alive(entry.keep),
                               "expires_in_s": None if entry.expires_at is None or not entry.ready
                               else round(max(0.0, entry.expires_at - now), 1),
                               "load_seconds": None if entry.load_seconds is None else round(entry.load_seconds, 3),
                               "path": str(entry.path)}
        if entry.evicting:
            out["unloading_when_idle"] = True
        if entry.state == "failed":
            out["error"] = entry.error or (entry.served.worker.error if entry.served is not None else None)
        if self.replicated and entry.ready:   # its replicas' state, memory and keep_alive (RemoteWorker)
            out.update(entry.served.worker.model_status())
        return out

    def card(self, entry: ModelEntry, card: Callable[[Any], dict[str, Any]], lmstudio: bool = False) -> dict[str, Any]:
        """A model's /v1/models (or /api/v0/models) card with its state and memory (`tinyloop`): the route's own
        card while it is loaded, else one read from its file's header."""
        if entry.ready:
            out = card(entry.served)
        else:
            out = offline_card(entry, lmstudio)
        return {**out, "tinyloop": self.status(entry)}

    def pool_status(self) -> dict[str, Any]:
        return {"max_loaded_models": self.max_loaded, "max_memory_bytes": self.max_memory,
                "loaded": sum(1 for e in self.entries if e.ready),
                "memory_bytes": sum(e.memory or 0 for e in self.entries if e.ready)}


_LOOPS_SUFFIX = re.compile(r"@loops=(auto|-?[0-9]+)$")   # (knobs.LOOPS_SUFFIX: a request's depth suffix)


def _bare(name: str) -> str:
    return _LOOPS_SUFFIX.sub("", name)


def build_pool(settings, metrics, make_worker: Callable[[Any, Any], Any]) -> ModelPool:
    """The pool of `settings`' models (`settings.models`, else `model_path` alone), each with its own
    settings, names and, once loaded, its own `EngineWorker` from `make_worker(settings, metrics)`."""
    from ..modelfile.header import resolve_model_path

    specs = settings.models or [None]
    entries: list[ModelEntry] = []
    taken: dict[str, str] = {}
    for spec in specs:
        own = settings if spec is None else model_settings(settings, spec)
        path = resolve_model_path(own.model_path)
        if len(specs) == 1:
            names = served_names(own.served_model_names or settings.served_model_names, path)
        else:
            names = list(dict.fromkeys(own.served_model_names or default_names(spec.source, path)))
        for name in names:
            if "@loops=" in name:
                raise SystemExit(f"tinyloop serve: a served model name cannot hold '@loops=', got {name!r}")
        clash = [n for n in names[:1] if n in taken]
        if clash:
            raise SystemExit(f"tinyloop serve: two models are named {clash[0]!r} ({taken[clash[0]]} and {path}); "
                             "name them: NAME=PATH, or `names` in the config")
        names = [n for n in names if n not in taken]   # (a later model's derived alias that an earlier one holds)
        for n in names:
            taken[n] = str(path)
        try:
            created = int(path.stat().st_mtime)
        except OSError:
            created = int(time.time())
        entries.append(ModelEntry(own, names, path, created))
    if len(entries) > 1 and DEFAULT_NAME not in taken:   # the README's examples' name: the first model
        entries[0].names.append(DEFAULT_NAME)

    def make_state(entry: ModelEntry):
        state = ServerState(entry.settings, make_worker(entry.settings, metrics), metrics, names=entry.names,
                            created=entry.created)
        state.model_path = str(entry.path)
        return state

    pool = ModelPool(settings, metrics, entries, make_state)
    if pool.single:   # one model: its state exists from the start, as before (loaded by start / serve)
        entries[0].served = make_state(entries[0])
        entries[0].load_started = time.monotonic()
    return pool
