"""`/metrics` of a scaled-out server: per replica.

The ingress counts HTTP requests (`tinyloop_http_requests_total`, as a single server does); every engine
metric comes from the replicas, each series with a `replica` label, as each replica last reported it
(`EngineReplica.record_routing_stats`, every `STATS_PERIOD_S`). Sum over the label for the cluster:
`sum without (replica) (rate(tinyloop_generated_tokens_total[1m]))`. A replica that died takes its series
with it (a counter reset for Prometheus' `rate`). `tinyloop_replicas{state}` and
`tinyloop_replicas_target` say how many replicas serve against how many should.

Several models: every replica series also has a `model` label (its model's id), and so do
`tinyloop_replicas{model,state}` and `tinyloop_replicas_target{model}`. A model's loads, unloads and load
seconds (`tinyloop_model_loads_total`, `_unloads_total`, `_load_seconds`) and memory are counted by the ingress
as its replicas come and go (`RemoteWorker`: a replica's load is a load, a replica gone is an unload), and
`tinyloop_models_loaded` is the models with a replica ready; the prompt cache on disk
(`tinyloop_prompt_cache_disk_bytes`, `_disk_hits_total`, ...) is per replica, as every engine metric.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ..server.metrics import Metrics

INGRESS_METRICS = {"tinyloop_http_requests", "tinyloop_model_loads", "tinyloop_model_unloads",
                   "tinyloop_model_load_seconds", "tinyloop_model_unload_seconds", "tinyloop_model_memory_bytes"}
MODELS_LOADED = "tinyloop_models_loaded"


class ClusterMetrics(Metrics):
    """`replicas()` and `target` for one model; `groups()`: (model id or None, target, replicas) per model."""

    def __init__(self, replicas: Callable[[], list[dict[str, Any]]] | None = None, target: int = 0, *,
                 groups: Callable[[], list[tuple[str | None, int, list[dict[str, Any]]]]] | None = None):
        super().__init__()
        self.replicas = replicas or (lambda: [])
        self.target = target
        self.groups = groups or (lambda: [(None, self.target, self.replicas())])

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    def __init__(self, metrics: ClusterMetrics):
        self.metrics = metrics

    def collect(self):
        for family in self.metrics.registry.collect():
            if family.name in INGRESS_METRICS:
                yield family
        groups = self.metrics.groups()
        merged: dict[str, Metric] = {}
        for model, _, reps in groups:
            tag = {} if model is None else {"model": model}
            for rep in reps:
                for family in text_string_to_metric_families(rep.get("metrics", "")):
                    if family.name in INGRESS_METRICS or family.name == MODELS_LOADED \
                            or family.name.endswith("_created"):
                        continue
                    out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                    for s in family.samples:
                        out.add_sample(s.name, {**s.labels, "replica": rep["id"], **tag}, s.value)
        yield from merged.values()
        several = any(model is not None for model, _, _ in groups)
        labels = ["model", "state"] if several else ["state"]
        states = GaugeMetricFamily("tinyloop_replicas", "engine replicas by state", labels=labels)
        target = GaugeMetricFamily("tinyloop_replicas_target", "engine replicas that should run (the autoscaling "
                                   "minimum when autoscaling; 0: it may scale to zero)",
                                   labels=["model"] if several else None)
        for model, want, reps in groups:
            for state in sorted({r.get("state", "unknown") for r in reps} | {"ready"}):
                n = sum(r.get("state", "unknown") == state for r in reps)
                states.add_metric([model, state] if several else [state], n)
            target.add_metric([model] if several else [], want)
        yield states
        yield target
        yield GaugeMetricFamily(MODELS_LOADED, "models with an engine replica ready",
                                value=sum(any(r.get("state") == "ready" for r in reps) for _, _, reps in groups))
