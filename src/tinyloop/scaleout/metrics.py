"""`/metrics` of a scaled-out server: per replica.

The ingress counts HTTP requests (`tinyloop_http_requests_total`, as a single server does); every engine
metric comes from the replicas, each series with a `replica` label, as each replica last reported it
(`EngineReplica.record_routing_stats`, every `STATS_PERIOD_S`). Sum over the label for the cluster:
`sum without (replica) (rate(tinyloop_generated_tokens_total[1m]))`. A replica that died takes its series
with it (a counter reset for Prometheus' `rate`). `tinyloop_replicas{state}` and
`tinyloop_replicas_target` say how many replicas serve against how many should.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ..server.metrics import Metrics

INGRESS_METRICS = {"tinyloop_http_requests"}


class ClusterMetrics(Metrics):
    def __init__(self, replicas: Callable[[], list[dict[str, Any]]] | None = None, target: int = 0):
        super().__init__()
        self.replicas = replicas or (lambda: [])
        self.target = target

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
        reps = self.metrics.replicas()
        merged: dict[str, Metric] = {}
        for rep in reps:
            for family in text_string_to_metric_families(rep.get("metrics", "")):
                if family.name in INGRESS_METRICS or family.name.endswith("_created"):
                    continue
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "replica": rep["id"]}, s.value)
        yield from merged.values()
        states = GaugeMetricFamily("tinyloop_replicas", "engine replicas by state", labels=["state"])
        for state in sorted({r.get("state", "unknown") for r in reps} | {"ready"}):
            states.add_metric([state], sum(r.get("state", "unknown") == state for r in reps))
        yield states
        yield GaugeMetricFamily("tinyloop_replicas_target", "engine replicas that should run (the autoscaling "
                                "minimum when autoscaling)", value=self.metrics.target)
