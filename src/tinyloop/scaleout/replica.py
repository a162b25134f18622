"""An engine replica: one `EngineWorker` (one model copy, one continuous batch, one KV pool) as a Ray
Serve deployment. The ingress streams each planned request through `generate`; the controller polls
`record_routing_stats` (the load the router ranks replicas by, and the replica's Prometheus metrics) and
`check_health` (a replica whose engine thread failed is replaced)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..engine import RequestPlan
from ..server.access import request_id_var, setup_logging
from ..server.errors import APIError
from ..server.metrics import Metrics
from ..server.settings import Settings
from ..server.worker import EngineWorker
from .wire import encode


class EngineReplica:
    def __init__(self, settings: Settings, threads: int = 0):
        if threads > 0:  # each replica owns its share of the cores (Ray's num_cpus for it)
            torch.set_num_threads(threads)
        setup_logging(settings.log_format, "info")
        self.metrics = Metrics()
        began = time.monotonic()
        self.worker = EngineWorker(settings, self.metrics).start()
        self.worker.ready.wait()  # Ray routes to a replica once its constructor returns: the model is loaded
        self.load_seconds = time.monotonic() - began
        self.memory_bytes = 0
        if self.worker.state == "ready":
            from ..server.model_memory import measure_bytes

            self.memory_bytes = measure_bytes(self.worker)

    async def generate(self, plan: RequestPlan, timeout_s: float | None, request_id: str | None):
        """The request's worker items in wire form, in lists of whatever was ready at once; the list
        holding None is the last. A refusal (429 queue full, 503) is the one item of the first list."""
        token = request_id_var.set(request_id)  # the engine's log lines about it carry the client's id
        try:
            handle = self.worker.submit(plan, timeout_s=timeout_s)
        except APIError as err:
            yield [encode(err), None]
            return
        finally:
            request_id_var.reset(token)
        try:
            while True:
                items = [await handle.next()]
                items += handle.ready_now()
                yield [encode(item) for item in items]
                if items[-1] is None:
                    handle.delivered = True
                    return
        finally:
            if not handle.delivered:  # the ingress cancelled it (its client left) or this generator was closed
                handle.abort()

    def ping(self) -> int:
        return os.getpid()

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the Serve controller every `request_routing_stats_period_s`; read by `router.py`."""
        w = self.worker
        stats: dict[str, Any] = {"pid": os.getpid(), "threads": torch.get_num_threads(), "state": w.state,
                                 "waiting": w.queue_depth, "active": len(w._active),
                                 "load_seconds": round(self.load_seconds, 3), "memory_bytes": self.memory_bytes,
                                 "metrics": self.metrics.render().decode()}
        if w.error:
            stats["error"] = w.error
        if w.batch is not None:
            pool = w.batch.sched.pool
            stats.update(running=w.batch.num_running, kv_pages_free=pool.num_free, kv_pages=pool.n_pages,
                         max_num_seqs=w.settings.max_num_seqs)
        return stats

    def check_health(self) -> None:
        """Ray replaces a replica whose check raises: one whose engine thread failed while serving (a model
        that never loaded fails the same way on every replica, so that one stays and answers 503)."""
        if self.worker.state == "failed" and self.worker.batch is not None:
            raise RuntimeError(self.worker.error or "the engine thread failed")

    def __del__(self):  # Serve's graceful shutdown: in-flight requests get the grace period
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop()
