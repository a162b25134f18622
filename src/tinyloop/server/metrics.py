"""Prometheus metrics of one server instance (its own registry, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LOOP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tinyloop_http_requests", "HTTP requests by route, method and status code",
                                ["route", "method", "status"], registry=r)
        self.prompt_tokens = Counter("tinyloop_prompt_tokens", "prompt tokens processed", registry=r)
        self.prompt_tokens_cached = Counter("tinyloop_prompt_tokens_cached",
                                            "prompt tokens whose KV came from the prefix cache", registry=r)
        self.generated_tokens = Counter("tinyloop_generated_tokens", "tokens generated", registry=r)
        self.generations = Counter("tinyloop_generations", "finished generations by finish reason",
                                   ["finish_reason"], registry=r)
        self.aborted = Counter("tinyloop_aborted_requests",
                               "generations aborted because the client went away", registry=r)
        self.failed = Counter("tinyloop_failed_requests", "generations that ended in an error", registry=r)
        self.ttft = Histogram("tinyloop_time_to_first_token_seconds",
                              "submit to first generated token (queue wait + prefill + one step)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("tinyloop_queue_wait_seconds", "time a request waited for the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.generation_seconds = Histogram("tinyloop_generation_seconds", "engine time per request",
                                            buckets=LATENCY_BUCKETS, registry=r)
        self.loops_per_token = Histogram("tinyloop_loops_per_token",
                                         "core loops each generated token ran (varies with loops \"auto\")",
                                         buckets=LOOP_BUCKETS, registry=r)
        self.queue_depth = Gauge("tinyloop_queue_depth", "requests waiting for the engine", registry=r)
        self.active = Gauge("tinyloop_active_generations",
                            "requests the engine is generating for now (each holds a KV cache)", registry=r)
        self.running = Gauge("tinyloop_running_sequences", "sequences in the running batch", registry=r)
        self.kv_pages_used = Gauge("tinyloop_kv_pages_used", "KV cache pages held by sequences", registry=r)
        self.engine_loaded = Gauge("tinyloop_engine_loaded", "1 when the model is loaded and serving", registry=r)
        # the model pool (server/models.py): loads, unloads, their seconds, what is loaded
        self.model_loads = Counter("tinyloop_model_loads", "model loads by model and outcome (ok, failed)",
                                   ["model", "outcome"], registry=r)
        self.model_unloads = Counter("tinyloop_model_unloads",
                                     "model unloads by model and reason (keep_alive, lru)", ["model", "reason"],
                                     registry=r)
        self.model_load_seconds = Histogram("tinyloop_model_load_seconds", "seconds a model's load took",
                                            ["model"], buckets=LOAD_BUCKETS, registry=r)
        self.model_unload_seconds = Histogram("tinyloop_model_unload_seconds",
                                              "seconds a model's unload took (its engine stopped, memory freed)",
                                              ["model"], buckets=LOAD_BUCKETS, registry=r)
        self.models_loaded = Gauge("tinyloop_models_loaded", "models loaded now", registry=r)
        self.model_memory = Gauge("tinyloop_model_memory_bytes",
                                  "bytes a loaded model's weights and KV pool hold (0: not loaded)", ["model"],
                                  registry=r)
        self._prompt_caches: list = []

    def track_prompt_cache(self, stats) -> None:
        """The prompt cache on disk's figures (`stats()`: engine/disk_cache.py DiskPrefixCache.stats), read at
        each scrape. Several models' caches (one each) are summed, the directory's bytes taken once."""
        if not self._prompt_caches:
            self.registry.register(_PromptCacheCollector(self._prompt_cache_stats))
        self._prompt_caches.append(stats)

    def untrack_prompt_cache(self, stats) -> None:
        """A model unloaded: its cache's figures leave the sums (what it counted stays: the counters are
        kept as a base)."""
        if stats in self._prompt_caches:
            self._gone = _add_stats(getattr(self, "_gone", {}), stats() or {})
            self._prompt_caches.remove(stats)

    def _prompt_cache_stats(self) -> dict:
        out = dict(getattr(self, "_gone", {}))
        out.pop("bytes", None)
        for stats in self._prompt_caches:
            out = _add_stats(out, stats() or {})
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _add_stats(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # the directory's bytes: every model's cache sees the whole directory
            out[key] = max(out.get(key, 0), value) if key == "bytes" else out.get(key, 0) + value
    return out


class _PromptCacheCollector:
    FAMILIES = (  # (name, kind, stats key, help)
        ("tinyloop_prompt_cache_disk_bytes", "gauge", "bytes",
         "bytes of the prompt cache directory on disk (every model's blocks and saved conversations)"),
        ("tinyloop_prompt_cache_disk_hits", "counter", "hits", "KV blocks read back from the prompt cache on disk"),
        ("tinyloop_prompt_cache_disk_hit_tokens", "counter", "hit_tokens",
         "prompt tokens whose KV was read back from the prompt cache on disk"),
        ("tinyloop_prompt_cache_disk_misses", "counter", "misses",
         "lookups past the in-memory prefix cache that found no file on disk"),
        ("tinyloop_prompt_cache_files_written", "counter", "written", "KV block files written to the prompt cache"),
        ("tinyloop_prompt_cache_files_ignored", "counter", "ignored",
         "prompt cache files ignored and removed: truncated, failing their checksum, or another model's, "
         "format's or version's"),
        ("tinyloop_prompt_cache_files_evicted", "counter", "evicted",
         "prompt cache files removed least recently used first past the byte bound"),
        ("tinyloop_prompt_cache_blocks_preloaded", "counter", "preloaded",
         "KV blocks read from disk into the prefix cache at start, while the engine was idle"),
        ("tinyloop_prompt_cache_writes_deferred", "counter", "dropped",
         "KV blocks not copied when named (the writer's queue was full); written at shutdown if still cached"),
    )

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self.stats() or {}
        for name, kind, key, doc in self.FAMILIES:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield cls(name, doc, value=values.get(key, 0))
