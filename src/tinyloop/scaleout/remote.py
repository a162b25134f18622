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
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException

from ..engine import Engine, RequestPlan
from ..server.errors import APIError
from ..server.settings import Settings
from ..server.worker import EngineWorker, RequestHandle, load_engine
from . import router
from .wire import decode

log = logging.getLogger("tinyloop.server")
ATTEMPTS = 3          # sends of one request before its failure is the client's
RETRY_PAUSE_S = 0.2   # between them (Ray notices a dead replica and routes around it)
RETRYABLE = {429, 503}


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
                 loader=None):
        super().__init__(settings, metrics, loader=loader or load_planning_engine)
        self.engines = engines.options(stream=True)
        self.deployment = deployment
        self.target_replicas = target_replicas   # the fixed count, or the autoscaling minimum

    def start(self) -> "RemoteWorker":
        super().start()
        self._warm = asyncio.get_running_loop().create_task(self._warm_up())
        return self

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
        try:
            await self._stream(handle)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - never a request left without an end
            log.exception("forwarding a request to a replica failed", extra={"request_id": handle.request_id})
            handle._push(APIError(500, f"the ingress failed on this request: {type(exc).__name__}: {exc}",
                                  code="engine_error"))
            handle._push(None)

    async def _stream(self, handle: RemoteHandle) -> None:
        """Send the request to a replica and feed its items to `handle`, sending it again (to another
        replica) when it was refused or its replica died before it produced anything."""
        for attempt in range(1, ATTEMPTS + 1):
            received = False
            gen = None
            try:
                gen = self.engines.generate.remote(handle.plan, handle.timeout_s, handle.request_id)
                async for batch in gen:
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


class _Refused(Exception):
    def __init__(self, err: APIError):
        super().__init__(err.message)
        self.err = err
