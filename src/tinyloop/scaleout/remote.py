"""The ingress's worker: the `EngineWorker` interface (`submit` -> a `RequestHandle`, `require_engine`,
`health`, start/stop) over engine replicas on Ray Serve.

The ingress loads the model file too, but only for what routes need before a request is queued:
tokenizer, config, chat template, `Engine.plan` and `model_info`. Its weights are moved to the meta
device once loaded (no second copy of them in memory); only replicas run the model.

`submit` returns the same `RequestHandle` the routes already read; a task streams the plan from a
replica through the deployment handle and pushes each item into it. Faults: a replica that dies (or
refuses with 429/503) before the request produced anything is retried on another replica, invisibly to
the client; one that dies after that ends the request with a 503 `replica_failed` error, which a stream
sends as an error event followed by `[DONE]`, like any other engine failure.

Several models (scaleout/app.py): the ingress's pool has one `RemoteWorker` per model, each streaming from its
own model's deployment. `model_status` is what /v1/models and `tinyloop ps` show of the model (its replicas'
state and memory, its keep_alive), and a watcher counts the model's loads and unloads as its replicas come
and go (a deployment that scales to zero by keep_alive loads again when a request waits for it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException

from ..engine import Engine, RequestPlan
from ..server.errors import APIError
from ..server.settings import Settings, show_keep_alive
from ..server.worker import EngineWorker, RequestHandle, load_engine
from . import router
from .wire import decode

log = logging.getLogger("tinyloop.server")
ATTEMPTS = 3          # sends of one request before its failure is the client's
RETRY_PAUSE_S = 0.2   # between them (Ray notices a dead replica and routes around it)
RETRYABLE = {429, 503}
WATCH_PERIOD_S = 1.0  # the model's replica set is compared with the last one this often (loads, unloads)


def load_planning_engine(settings: Settings) -> tuple[Engine, list[str]]:
    """`load_engine` (the same checks and warnings as a replica's), with the weights dropped."""
    engine, warnings = load_engine(settings)
    engine.model.to("meta")
    return engine, warnings


@dataclass(eq=False)
class RemoteHandle(RequestHandle):
    task: asyncio.Task | None = None

    def abort(self) -> None:  # the client went away: cancelling the stream cancels it on the replica
        super().abort()
        if self.task is not None and not self.task.done():
            self.task.cancel()


class RemoteWorker(EngineWorker):
    """`EngineWorker`'s interface, with requests served by the replicas of `deployment` (a Serve handle)."""

    def __init__(self, settings: Settings, metrics, engines, *, deployment: str, target_replicas: int,
                 loader=None, model=None, name: str = ""):
        super().__init__(settings, metrics, loader=loader or load_planning_engine)
        self.engines = engines.options(stream=True)
        self.deployment = deployment
        self.target_replicas = target_replicas   # the fixed count, or the autoscaling minimum (0: scales to zero)
        self.model = model                       # app.ModelDeployment (None: one model, sized by target_replicas)
        self.name = name                         # the model's id (its metrics' label)
        self.in_flight = 0                       # requests sent to the deployment, not ended yet
        self._seen: dict[str, dict[str, Any]] = {}   # replica id -> its last report (loads and unloads)
        self._tasks: list[asyncio.Task] = []

    @property
    def to_zero(self) -> bool:
        return self.model is not None and self.model.to_zero

    def start(self) -> "RemoteWorker":
        super().start()
        loop = asyncio.get_running_loop()
        if self.model is None or self.model.warm:   # (a model at zero replicas: a ping would load it)
            self._tasks.append(loop.create_task(self._warm_up()))
        self._tasks.append(loop.create_task(self._watch()))
        return self

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        super().stop()

    async def _watch(self) -> None:
        """A replica that appears is a load of the model (its load seconds as it reported them), one that goes
        (scaled down, or died) an unload; the model's memory is its replicas'."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                self._count(self.replicas())
            except Exception:  # noqa: BLE001 - metrics only
                log.exception("watching the replicas of %s failed", self.deployment)

    def _count(self, replicas: list[dict[str, Any]]) -> None:
        """(the event loop) Loads and unloads since the last look (also on each /v1/models: the two agree)."""
        m = self.metrics
        reps = {r["id"]: r for r in replicas if "load_seconds" in r}
        for rid in reps.keys() - self._seen.keys():
            m.model_loads.labels(self.name, "ok" if reps[rid].get("state") != "failed" else "failed").inc()
            m.model_load_seconds.labels(self.name).observe(reps[rid]["load_seconds"])
        for rid in self._seen.keys() - reps.keys():
            m.model_unloads.labels(self.name, "replica_gone").inc()
        self._seen = reps
        m.model_memory.labels(self.name).set(sum(r.get("memory_bytes", 0) for r in reps.values()))

    def model_status(self) -> dict[str, Any]:
        """The model's state as its replicas make it (what the pool's /v1/models card shows on Ray Serve)."""
        reps = self.replicas()
        self._count(reps)
        # (a replica that has not reported yet is loaded: Ray routes to one once its constructor, the load, ended)
        ready = [r for r in reps if r.get("state", "ready") == "ready"]
        failed = [r for r in reps if r.get("state") == "failed"]
        if ready:
            state = "loaded"
        elif failed and not self.in_flight:
            state = "failed"
        elif self.in_flight or not self.to_zero:
            state = "loading"   # (a request waits for a replica of a model at zero, or they are starting)
        else:
            state = "unloaded"
        keep = self.model.keep_alive if self.model is not None else None
        out: dict[str, Any] = {"state": state, "memory_bytes": sum(r.get("memory_bytes", 0) for r in ready),
                               "pinned": not self.to_zero, "keep_alive": show_keep_alive(keep), "expires_in_s": None,
                               "replicas": {"deployment": self.deployment, "ready": len(ready),
                                            "min": self.target_replicas,
                                            "max": self.model.most if self.model is not None else None}}
        loads = [r["load_seconds"] for r in ready if r.get("load_seconds") is not None]
        if loads:
            out["load_seconds"] = round(max(loads), 3)
        if state == "failed":
            out["error"] = failed[0].get("error") or "the model failed to load on its replicas"
        return out

    async def _warm_up(self) -> None:
        """One call through the handle makes its router (and so the replica list /health reads) exist
        before the first request."""
        try:
            await self.engines.options(stream=False).ping.remote()
        except (RayError, RayServeException) as exc:
            log.warning("no engine replica answered yet: %s", exc)

    def _run(self) -> None:  # the loading thread: the planning engine only; nothing runs here afterwards
        try:
            self.engine, warnings = self.loader(self.settings)
            self.warnings += warnings
            self.state = "ready"
        except Exception as exc:  # noqa: BLE001 - the server stays up and reports why
            self.state, self.error = "failed", str(exc) or type(exc).__name__
            log.error("the model failed to load: %s", self.error)
        finally:
            self.ready.set()

    def replicas(self) -> list[dict[str, Any]]:
        return router.replicas(self.deployment) or []

    @property
    def queue_depth(self) -> int:
        return sum(r.get("waiting", 0) for r in self.replicas())

    def health(self) -> dict[str, Any]:
        """`ok` at full capacity; `degraded` (still 200: it serves) while fewer replicas than the target run;
        `starting` (503) while none is ready."""
        reps = self.replicas()
        ready = sum(r.get("state") == "ready" for r in reps)
        if not ready and self.to_zero:   # at zero by its keep_alive: it serves (its next request loads it)
            return {"queue_depth": 0, "model_state": self.model_status()["state"],
                    "replicas": {"ready": 0, "target": 0, "each": []}}
        out: dict[str, Any] = {
            "queue_depth": sum(r.get("waiting", 0) for r in reps),
            "replicas": {"ready": ready, "target": self.target_replicas,
                         "each": [{k: r.get(k) for k in ("id", "pid", "threads", "state", "waiting", "running",
                                                         "kv_pages_free", "kv_pages")} for r in reps]}}
        if ready == 0:  # not serving yet: /health answers 503 until a replica is (readiness probes)
            out["status"] = "starting"
            out["reason"] = f"no engine replica is ready yet (0 of {self.target_replicas})"
        elif ready < self.target_replicas:
            out["status"] = "degraded"
        return out

    def submit(self, plan: RequestPlan, *, timeout_s: float | None = None) -> RequestHandle:
        self.check_open()
        if timeout_s is None and self.settings.request_timeout_s > 0:
            timeout_s = self.settings.request_timeout_s
        handle = RemoteHandle(plan, asyncio.get_running_loop(), timeout_s=timeout_s)
        handle.task = asyncio.create_task(self._pump(handle))
        return handle

    async def _pump(self, handle: RemoteHandle) -> None:
        """Stream the request from a replica into `handle`; whatever goes wrong, the handle gets an end."""
        self.in_flight += 1
        try:
            await self._stream(handle)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - never a request left without an end
            log.exception("forwarding a request to a replica failed", extra={"request_id": handle.request_id})
            handle._push(APIError(500, f"the ingress failed on this request: {type(exc).__name__}: {exc}",
                                  code="engine_error"))
            handle._push(None)
        finally:
            self.in_flight -= 1

    async def _stream(self, handle: RemoteHandle) -> None:
        """Send the request to a replica and feed its items to `handle`, sending it again (to another
        replica) when it was refused or its replica died before it produced anything."""
        for attempt in range(1, ATTEMPTS + 1):
            received = False
            gen = None
            try:
                gen = self.engines.generate.remote(handle.plan, handle.timeout_s, handle.request_id)
                async for batch in self._batches(gen, handle):
                    items = [decode(item) for item in batch]
                    first = items[0]
                    if not received and isinstance(first, APIError) and first.status in RETRYABLE \
                            and attempt < ATTEMPTS and not self._closing:
                        raise _Refused(first)
                    received = True
                    for item in items:
                        handle._push(item)
                return
            except asyncio.CancelledError:
                if gen is not None:
                    gen.cancel()
                raise
            except _NoReplica as late:   # (its model at zero replicas, none started in time)
                gen.cancel()
                handle._push(APIError(504, f"model {self.name!r} was not loaded within {late.limit:g} s "
                                           f"({self.model_status()['state']})", code="timeout"))
                handle._push(None)   # (the request's own timeout_s: the route answers the client's 408)
                return
            except _Refused as refused:
                log.info("replica refused the request (%s); sending it again", refused.err.code,
                         extra={"request_id": handle.request_id})
            except BackPressureError:
                handle._push(APIError(429, "every engine replica's queue is full; retry later", code="queue_full",
                                      headers={"Retry-After": "1"}))
                handle._push(None)
                return
            except (RayError, RayServeException) as exc:
                if received or attempt == ATTEMPTS or self._closing:
                    log.warning("the replica serving a request failed: %s", type(exc).__name__,
                                extra={"request_id": handle.request_id})
                    handle._push(APIError(503, "the engine replica serving this request failed "
                                               f"({type(exc).__name__}); retry the request",
                                          code="replica_failed", headers={"Retry-After": "1"}))
                    handle._push(None)
                    return
                log.info("replica failed before the request started (%s); sending it again", type(exc).__name__,
                         extra={"request_id": handle.request_id})
            await asyncio.sleep(RETRY_PAUSE_S)

    def _serving(self) -> bool:
        """A replica of this model is ready (one that has not reported yet is: Ray routes to it once loaded)."""
        return any(r.get("state", "ready") == "ready" for r in self.replicas())

    async def _batches(self, gen, handle: RemoteHandle):
        """`gen`'s batches. While the model has no replica ready (scaled to zero, or starting) the wait for the
        first is bounded by the request's timeout, as a load's is in one process; once a replica serves, the
        replica's engine bounds it (its queue wait)."""
        nxt = asyncio.ensure_future(gen.__anext__())
        limit = handle.timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        try:
            while deadline is not None and not self._serving():
                done, _ = await asyncio.wait({nxt}, timeout=0.25)
                if done:
                    break
                if time.monotonic() >= deadline:
                    raise _NoReplica(limit)
            first = await nxt
        except StopAsyncIteration:
            return
        finally:
            if not nxt.done():
                nxt.cancel()
        yield first
        async for batch in gen:
            yield batch


class _NoReplica(Exception):
    def __init__(self, limit: float):
        super().__init__(f"no replica within {limit:g} s")
        self.limit = limit


class _Refused(Exception):
    def __init__(self, err: APIError):
        super().__init__(err.message)
        self.err = err
