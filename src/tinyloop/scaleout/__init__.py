"""Scale-out: TinyLoop replicas on Ray Serve behind the same OpenAI API (docs/scale-out.md).

`tinyloop serve --replicas N` runs a Ray Serve application of two deployments:

    ingress (1 replica)   the same FastAPI app as single-process serving (`server.app.create_app`), every
                          route, SSE frame, error and auth path unchanged; its worker is a `RemoteWorker`
                          that plans each request as usual and streams it from an engine replica
    engine (N replicas)   `EngineReplica`: one `EngineWorker` each (one continuous batch, one model copy)

Routing (`router.py`) picks between two random replicas by the load they report (requests in flight,
free KV pages). Nothing here is imported by single-process `tinyloop serve`, and only `app.py`,
`replica.py`, `remote.py` and `router.py` import Ray (the optional extra `tinyloop[ray]`).
"""

import os
from typing import Any

ROUTERS: dict[str, Any] = {}   # deployment name -> its `router.EngineRouter` in this process


def local_cluster_env() -> None:
    """Call before Ray is imported, for a one-machine cluster. Ray turns `_node_ip_address="127.0.0.1"`
    into the machine's outward address (so that other nodes could join) and binds its services there;
    with multi-node clusters switched off (read when Ray is imported) it keeps the loopback address.
    No token auth for a cluster nothing outside this machine can reach, unless the caller set a mode."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def refusal(settings, min_replicas: int | None = None) -> str | None:
    """Why `settings` cannot be served on Ray Serve, in one line (None: they can). Torch- and Ray-free: `tinyloop
    serve` asks before it starts anything. On Ray each model is its own deployment: its replicas load at start
    (keep_alive none or -1) or scale between 0 and N (keep_alive T: the replicas go T s after the last request;
    the next request waits for one); nothing chooses between models, so the pool's bounds do not apply."""
    from ..server.settings import PINNED

    if settings.max_loaded_models is not None or settings.max_memory is not None:
        return ("--max-loaded-models and --max-memory do not apply on Ray Serve (--replicas): each model has its "
                "own deployment, its replicas placed by the CPUs they reserve (--replica-cpus) and gone when its "
                "keep_alive runs out (docs/scale-out.md, \"Several models\")")
    if min_replicas and settings.keep_alive is not None and settings.keep_alive != PINNED:
        return ("--keep-alive scales every model's replicas to zero on Ray Serve, --min-replicas keeps some: give one "
                "of them (a model's own keep_alive in a models config file wins over --min-replicas)")
    return None
