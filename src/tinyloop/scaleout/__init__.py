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
