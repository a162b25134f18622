"""Routing that suits an LLM engine, as a Ray Serve request router (`RequestRouterConfig`, Ray >= 2.45).

Power of two choices on the engine's own load: for each request two random replicas are drawn and
ranked by (requests in flight there, then the larger share of free KV pages first). Requests in flight
come from the router's own count (updated as it sends and as replicas answer Ray's queue-length probe:
exact for this ingress); a replica it has no count for is ranked by what it last reported through
`EngineReplica.record_routing_stats` (running + waiting). Ray then sends the request to the first-ranked
replica unless that one is at its `max_ongoing_requests` (the engine's batch plus its queue), else to
the second. Round-robin would ignore that a replica is still busy with long generations.

The router lives in the process that holds the deployment handle (the ingress): it registers itself in
`scaleout.ROUTERS`, so the ingress can read the replica set and each replica's last report (`replicas`),
for `/health` and `/metrics`. (Serve pickles this module by value into that process: the registry must
live in another module, which is pickled by reference.)
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

import tinyloop.scaleout as registry


class EngineRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        registry.ROUTERS[self._deployment_id.name] = self

    def load(self, replica: RunningReplica) -> tuple[float, float]:
        stats = replica.routing_stats or {}
        in_flight = self.replica_queue_len_cache.get(replica.replica_id)
        if in_flight is None:
            in_flight = stats.get("active", 0) + stats.get("waiting", 0)
        free_share = stats.get("kv_pages_free", 0) / max(1, stats.get("kv_pages", 1))
        return in_flight, -free_share

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, 2) if len(candidate_replicas) > 2 else list(candidate_replicas)
        random.shuffle(pair)  # equal loads: either one
        return [[r] for r in sorted(pair, key=self.load)]


def replicas(deployment: str) -> list[dict[str, Any]] | None:
    """The running replicas of `deployment` as this process's router sees them (id and last report), or
    None before the handle's router exists."""
    router = registry.ROUTERS.get(deployment)
    if router is None:
        return None
    return [{"id": rid.unique_id, **(r.routing_stats or {})} for rid, r in sorted(router.curr_replicas.items(),
                                                                               key=lambda kv: kv[0].unique_id)]
