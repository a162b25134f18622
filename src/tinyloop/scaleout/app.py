"""The Ray Serve application: `build_app(settings, scale)`, `tinyloop serve --replicas N` (`serve_cluster`),
and `app_builder` for a Serve config file (`serve run serve.yaml`, `serve deploy`; docs/scale-out.md).

Several models (`tinyloop serve A B --replicas N`): one engine deployment per model, each with its own
settings (`model_settings`) and replicas, named `TinyLoopEngine-<its first name>` (one model: `TinyLoopEngine`),
and one ingress whose model pool routes each request to its model's deployment (a `RemoteWorker` each, found
by `model_key`: the model's path and names, which the ingress's pool derives from the same specs). A model with
a keep_alive of T seconds autoscales between 0 and N replicas (its replicas go about T s after its last
request; a request to a model at zero waits for its replica); one without (or pinned) keeps its replicas."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from dataclasses import dataclass, replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..server import access
from ..server.app import create_app
from ..server.model_specs import model_settings
from ..server.settings import PINNED, Settings
from . import refusal, router
from .metrics import ClusterMetrics
from .remote import RemoteWorker
from .replica import EngineReplica

log = logging.getLogger("tinyloop.server")
APP_NAME = "tinyloop"
ENGINE = "TinyLoopEngine"
INGRESS = "TinyLoopIngress"
STATS_PERIOD_S = 1.0      # replicas report their load (and metrics) this often
HEALTH_PERIOD_S = 2.0     # the controller checks each replica this often
LOOK_BACK_S = 15.0        # a keep_alive model: the autoscaler's window of requests (scale to zero needs it empty);
                          # over Ray's 10 s metrics push, so a long request always shows in it and keeps its replica


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


def model_key(settings: Settings) -> tuple[str, tuple[str, ...]]:
    """What ties a model's settings in the ingress's pool to its engine deployment, across processes: its path
    (as given) and its names (as given; two models cannot share a first name, so the pair is unique)."""
    return str(settings.model_path), tuple(settings.served_model_names or ())


@dataclass
class ModelDeployment:
    """One served model's engine deployment (plain data: it is shipped to the ingress)."""
    deployment: str                   # the Serve deployment's name
    key: tuple                        # model_key of its settings
    settings: Settings                # the model's own (what its replicas run with)
    sizing: dict[str, Any]            # num_replicas, or autoscaling_config
    target: int                       # replicas for full capacity (0: it may scale to zero)
    most: int                         # replicas at most
    keep_alive: float | None          # seconds its replicas stay after its last request (None / PINNED: always)
    warm: bool                        # replicas at start: the ingress pings it once (its router exists early)

    @property
    def to_zero(self) -> bool:
        return self.keep_alive is not None and self.keep_alive != PINNED


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:60] or "model"


def plan_models(settings: Settings, scale: ScaleOut) -> list[ModelDeployment]:
    """Each model's deployment: its settings, name and sizing (module docstring)."""
    from pathlib import Path

    specs = settings.models or [None]
    out: list[ModelDeployment] = []
    taken: set[str] = set()
    for spec in specs:
        own = settings if spec is None else model_settings(settings, spec)
        if len(specs) == 1:
            name = ENGINE
        else:
            stem = spec.names[0] if spec.names else Path(spec.source.removeprefix("hf:")).name.removesuffix(".tinyloop")
            name = base = f"{ENGINE}-{_slug(stem)}"
            n = 1
            while name in taken:
                n += 1
                name = f"{base}-{n}"
        taken.add(name)
        keep = own.keep_alive
        most = scale.most
        if keep is not None and keep != PINNED:   # 0..N replicas, gone keep_alive s after the last request
            initial = min(scale.replicas, most) if len(specs) == 1 else 0   # several: each loads on demand
            sizing = {"autoscaling_config": {"min_replicas": 0, "max_replicas": most, "initial_replicas": initial,
                                             "target_ongoing_requests": own.max_num_seqs, "upscale_delay_s": 5,
                                             "downscale_delay_s": 60, "downscale_to_zero_delay_s": keep,
                                             "look_back_period_s": LOOK_BACK_S}}
            out.append(ModelDeployment(name, model_key(own), own, sizing, 0, most, keep, initial > 0))
            continue
        sizing = {"num_replicas": scale.replicas}
        if scale.autoscaling:
            lo = scale.min_replicas or 1
            # Ray keeps the mean of (running + queued) per replica near the target: at the batch size, a
            # replica whose engine has a queue (requests beyond max_num_seqs) asks for another replica.
            sizing = {"autoscaling_config": {"min_replicas": lo, "max_replicas": most,
                                             "initial_replicas": min(max(scale.replicas, lo), most),
                                             "target_ongoing_requests": own.max_num_seqs,
                                             "upscale_delay_s": 5, "downscale_delay_s": 60}}
        out.append(ModelDeployment(name, model_key(own), own, sizing, scale.target, most, keep, True))
    keys = [m.key for m in out]
    if len(set(keys)) != len(keys):
        raise ValueError("two models have the same path and names; name them (NAME=PATH)")
    return out


def ingress_settings(settings: Settings) -> Settings:
    """The ingress's: its pool holds every model's planning engine (pinned) and no bound; the models' replicas
    load and go in their own deployments."""
    specs = [replace(spec, keep_alive=None) for spec in settings.models]
    return replace(settings, keep_alive=PINNED, max_loaded_models=None, max_memory=None, models=specs)


class Ingress:
    """The ingress deployment: `create_app`'s FastAPI app, its pool with a `RemoteWorker` per model."""

    def __init__(self, engines: list, settings: Settings, models: list[ModelDeployment]):
        self.engines, self.settings, self.models = engines, settings, models

    def __serve_build_asgi_app__(self):
        access.setup_logging(self.settings.log_format, "info")
        by_key = {m.key: (m, handle) for m, handle in zip(self.models, self.engines)}
        names: dict[tuple, str] = {}   # model key -> its id in the API
        several = len(self.models) > 1

        def groups():   # (one model: its series carry no model label, as before)
            return [(names.get(m.key) if several else None, m.target, router.replicas(m.deployment) or [])
                    for m in self.models]

        def factory(s: Settings, m):
            found = by_key.get(model_key(s))
            if found is None and len(by_key) == 1:
                found = next(iter(by_key.values()))
            if found is None:
                raise KeyError(f"no engine deployment serves the model {s.model_path} (names {s.served_model_names})")
            model, handle = found
            return RemoteWorker(s, m, handle, deployment=model.deployment, target_replicas=model.target,
                                model=model, name=names.get(model.key) or "")

        metrics = ClusterMetrics(groups=groups)
        app = create_app(self.settings, metrics=metrics, worker_factory=factory)
        pool = app.state.tl
        pool.replicated = True
        names.update({model_key(e.settings): e.name for e in pool.entries})
        if pool.single:
            names[self.models[0].key] = pool.entries[0].name
        return OneRequestIdHeader(app)


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
    why = refusal(settings, scale.min_replicas)
    if why:
        raise ValueError(why)
    threads = scale.threads or max(1, int(scale.replica_cpus))
    models = plan_models(settings, scale)
    engines, most_ongoing = [], settings.max_queue
    for model in models:
        own = model.settings
        per_replica = own.max_num_seqs + own.max_queue
        most_ongoing += per_replica * model.most
        engine = serve.deployment(
            EngineReplica, name=model.deployment, max_ongoing_requests=per_replica,
            max_queued_requests=own.max_queue, ray_actor_options={"num_cpus": scale.replica_cpus},
            health_check_period_s=HEALTH_PERIOD_S, graceful_shutdown_timeout_s=own.shutdown_grace_s + 5,
            request_router_config=RequestRouterConfig(request_router_class=router.EngineRouter,
                                                      request_routing_stats_period_s=STATS_PERIOD_S),
            **model.sizing)
        engines.append(engine.bind(own, threads))
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS, num_replicas=1,
                               max_ongoing_requests=most_ongoing, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines, ingress_settings(settings), models)


def app_builder(args: dict[str, Any]):
    """For a Serve config file: `import_path: tinyloop.scaleout.app:app_builder`, with `args` of
    `replicas`, `min_replicas`, `max_replicas`, `replica_cpus`, `threads` and `model` (one) or `models` (several:
    a list of what `tinyloop serve A B ...` takes, config files included); the rest of the settings come from the
    TINYLOOP_* environment (`runtime_env.env_vars`)."""
    known = {"replicas", "min_replicas", "max_replicas", "replica_cpus", "threads", "model", "models"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown tinyloop app args {sorted(unknown)}; known: {sorted(known)}")
    scale = ScaleOut(**{k: v for k, v in args.items() if k not in ("model", "models")})
    settings = Settings.from_env(model_path=args.get("model"))
    if args.get("models"):
        from ..server.model_specs import specs_from_args

        settings.models, _ = specs_from_args(list(args["models"]))
    return build_app(settings, scale)


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
        if len(settings.models) > 1:
            log.warning("tinyloop: %d models, each its own engine deployment (%s), serving on http://%s:%d (pid %d)",
                        len(settings.models), ", ".join(m.deployment for m in plan_models(settings, scale)), host,
                        port, os.getpid())
        else:
            log.warning("tinyloop: %d engine replica(s) serving on http://%s:%d (pid %d)", scale.target, host, port,
                        os.getpid())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
