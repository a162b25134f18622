"""The Ray Serve application: `build_app(settings, scale)`, `tinyloop serve --replicas N` (`serve_cluster`),
and `app_builder` for a Serve config file (`serve run serve.yaml`, `serve deploy`; docs/scale-out.md)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..server import access
from ..server.app import create_app
from ..server.settings import Settings
from . import router
from .metrics import ClusterMetrics
from .remote import RemoteWorker
from .replica import EngineReplica

log = logging.getLogger("tinyloop.server")
APP_NAME = "tinyloop"
ENGINE = "TinyLoopEngine"
INGRESS = "TinyLoopIngress"
STATS_PERIOD_S = 1.0      # replicas report their load (and metrics) this often
HEALTH_PERIOD_S = 2.0     # the controller checks each replica this often


@dataclass
class ScaleOut:
    replicas: int = 2                 # engine replicas (the initial count when autoscaling)
    min_replicas: int | None = None   # both set: autoscale between them on queue depth
    max_replicas: int | None = None
    replica_cpus: float = 1.0         # Ray CPUs reserved per replica
    threads: int = 0                  # torch threads per replica; 0: replica_cpus rounded, at least 1

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def target(self) -> int:
        """Replicas that must run for full capacity: the fixed count, or the autoscaling minimum."""
        return (self.min_replicas or 1) if self.autoscaling else self.replicas

    @property
    def most(self) -> int:
        return (self.max_replicas or self.replicas) if self.autoscaling else self.replicas

    def check(self) -> None:
        lo, hi = self.min_replicas or 1, self.max_replicas or max(self.replicas, self.min_replicas or 1)
        if self.replicas < 1 or lo < 1 or hi < lo:
            raise SystemExit(f"tinyloop serve: need 1 <= --min-replicas ({lo}) <= --max-replicas ({hi}) "
                             f"and --replicas >= 1 (got {self.replicas})")
        if self.replica_cpus <= 0:
            raise SystemExit("tinyloop serve: --replica-cpus must be positive")


class Ingress:
    """The ingress deployment: `create_app`'s FastAPI app, with a `RemoteWorker` for its worker."""

    def __init__(self, engines, settings: Settings, target: int):
        self.engines, self.settings, self.target = engines, settings, target

    def __serve_build_asgi_app__(self):
        access.setup_logging(self.settings.log_format, "info")
        metrics = ClusterMetrics(lambda: router.replicas(ENGINE) or [], self.target)
        return OneRequestIdHeader(create_app(self.settings, metrics=metrics, worker_factory=lambda s, m: RemoteWorker(
            s, m, self.engines, deployment=ENGINE, target_replicas=self.target)))


class OneRequestIdHeader:
    """Serve's HTTP proxy gives every request an `X-Request-Id` (the client's, else a UUID) and adds it to
    the response; the app adopts that id and would add the header a second time: its own copy is dropped
    when it says the same."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)

        async def send_once(message):
            if message["type"] == "http.response.start" and given is not None:
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                  if not (k.lower() == b"x-request-id" and v == given)]}
            await send(message)

        await self.app(scope, receive, send_once)


def build_app(settings: Settings, scale: ScaleOut):
    """The Serve application (bind it with `serve.run`). Each replica may queue as many requests as its
    engine takes (its batch plus its queue: `max_ongoing_requests`); past that the ingress holds at most
    `TINYLOOP_MAX_QUEUE` more before answering 429."""
    scale.check()
    threads = scale.threads or max(1, int(scale.replica_cpus))
    per_replica = settings.max_num_seqs + settings.max_queue
    sizing: dict[str, Any] = {"num_replicas": scale.replicas}
    if scale.autoscaling:
        lo, hi = scale.min_replicas or 1, scale.most
        # Ray keeps the mean of (running + queued) per replica near the target: at the batch size, a
        # replica whose engine has a queue (requests beyond max_num_seqs) asks for another replica.
        sizing = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi,
                                         "initial_replicas": min(max(scale.replicas, lo), hi),
                                         "target_ongoing_requests": settings.max_num_seqs,
                                         "upscale_delay_s": 5, "downscale_delay_s": 60}}
    engine = serve.deployment(
        EngineReplica, name=ENGINE, max_ongoing_requests=per_replica, max_queued_requests=settings.max_queue,
        ray_actor_options={"num_cpus": scale.replica_cpus}, health_check_period_s=HEALTH_PERIOD_S,
        graceful_shutdown_timeout_s=settings.shutdown_grace_s + 5,
        request_router_config=RequestRouterConfig(request_router_class=router.EngineRouter,
                                                  request_routing_stats_period_s=STATS_PERIOD_S),
        **sizing)
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS, num_replicas=1,
                               max_ongoing_requests=per_replica * scale.most + settings.max_queue,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(settings, threads), settings, scale.target)


def app_builder(args: dict[str, Any]):
    """For a Serve config file: `import_path: tinyloop.scaleout.app:app_builder`, with `args` of
    `replicas`, `min_replicas`, `max_replicas`, `replica_cpus`, `threads` and `model`; the rest of the
    settings come from the TINYLOOP_* environment (`runtime_env.env_vars`)."""
    known = {"replicas", "min_replicas", "max_replicas", "replica_cpus", "threads", "model"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown tinyloop app args {sorted(unknown)}; known: {sorted(known)}")
    scale = ScaleOut(**{k: v for k, v in args.items() if k != "model"})
    return build_app(Settings.from_env(model_path=args.get("model")), scale)


def serve_cluster(settings: Settings, scale: ScaleOut, *, host: str, port: int, log_level: str = "info",
                  ray_address: str | None = None) -> None:
    """`tinyloop serve --replicas N`: start (or join, with `ray_address`) a Ray cluster, run the app with
    its HTTP proxy on host:port, block until SIGINT/SIGTERM, then shut Serve down (and the local cluster).
    For a local cluster on loopback, `scaleout.local_cluster_env()` must have run before Ray was imported."""
    import ray

    access.setup_logging(settings.log_format, log_level)
    if ray_address:
        ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING)
    else:  # a cluster of this machine alone: every Ray service on loopback
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": log_level.upper()})
        serve.run(build_app(settings, scale), name=APP_NAME, route_prefix="/")
        log.warning("tinyloop: %d engine replica(s) serving on http://%s:%d (pid %d)", scale.target, host, port,
                    os.getpid())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
