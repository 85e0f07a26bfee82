"""Prometheus metrics (`GET /metrics`) and the readiness probe (`GET /ready`).

Request metrics are fed by a finish hook (one call per finished RequestContext); per-model
worker figures are read from the workers' client at scrape time by a custom collector, so nothing
runs in the background. Everything lives in the Metrics object's own registry.
"""

from __future__ import annotations

from collections.abc import Iterator

from litestar import Response, get
from litestar.datastructures import State
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.edge.context import RequestContext
from gateway.workers.client import ModelState, WorkerClient
from shared.modelinfo import kind_served

UNKNOWN = "-"  # the model label of a request that named no configured model (401, 400, 404)

# LLM serving spans milliseconds (a token) to minutes (a long generation).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

# A family of a heartbeat's stats Struct: its kind, its name after the prefix, its help, and
# the Struct's field it shows.
StatsFamily = tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, str]
GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily

PREFIX_CACHE: tuple[StatsFamily, ...] = (
    (GAUGE, "bytes", "KV cache bytes the prefix cache holds", "nbytes"),
    (GAUGE, "capacity_bytes", "The prefix cache's bound", "capacity_bytes"),
    (GAUGE, "entries", "Cached prefixes held", "entries"),
    (COUNTER, "lookups", "Requests that looked for a cached prefix", "lookups"),
    (COUNTER, "hits", "Requests that reused a cached prefix", "hits"),
    (COUNTER, "hit_tokens", "Prompt tokens served from the cache", "hit_tokens"),
    (COUNTER, "evictions", "Cached prefixes evicted", "evictions"),
    (COUNTER, "oversize", "KV caches not kept: each larger than the whole bound", "oversize"),
)
PROMPT_SEGMENTS: tuple[StatsFamily, ...] = (
    (GAUGE, "entries", "Chat prompt segments the memo holds", "entries"),
    (GAUGE, "bytes", "Bytes of segment text and token ids the memo holds", "nbytes"),
    (GAUGE, "capacity_bytes", "The prompt-segment memo's bound", "capacity_bytes"),
    (COUNTER, "prompts", "Chat prompts tokenized by segments", "prompts"),
    (COUNTER, "hits", "Prompt segments found in the memo", "hits"),
    (COUNTER, "misses", "Prompt segments encoded", "misses"),
    (COUNTER, "evictions", "Prompt segments evicted from the memo", "evictions"),
)


def counted(path: str) -> bool:
    """The requests the metrics (and the console) count: API requests, not /metrics,
    /health, /admin or the console's own."""
    return path.startswith("/v1/")


class Metrics:
    def __init__(self, workers: WorkerClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "mlxgw_requests", "Finished API requests", ["model", "status", "key"], registry=r
        )
        self.ttft = Histogram(
            "mlxgw_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.preprocess = Histogram(
            "mlxgw_request_preprocess_seconds",
            "Time a request took to prepare in its worker (chat template, tokenizing)",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "mlxgw_request_queue_seconds",
            "Time a request waited in its worker for a place in the batch",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "mlxgw_request_prefill_seconds",
            "Time from joining the batch to the first token, in the worker",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mlxgw_inter_token_latency_seconds",
            "Mean time between tokens after the first, one observation per request",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "mlxgw_request_duration_seconds",
            "Time from request arrival to the response's last byte",
            ["model", "stream"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mlxgw_prompt_tokens",
            "Prompt tokens of finished requests",
            ["model", "key"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "mlxgw_completion_tokens", "Generated tokens", ["model", "key"], registry=r
        )
        self.cached_tokens = Counter(
            "mlxgw_cached_prompt_tokens",
            "Prompt tokens of finished requests read from the worker's prefix cache",
            ["model", "key"],
            registry=r,
        )
        # Also read by the console's live figures (gateway/console/live.py): one source.
        self.worker_figures = WorkerCollector(workers)
        r.register(self.worker_figures)

    def observe(self, ctx: RequestContext) -> None:
        """The finish hook: only API requests count (not /metrics, /health, /admin)."""
        if not counted(ctx.path):
            return
        # Only configured names become labels: a label per name that callers make up would
        # let anyone grow the metrics without bound (the access log keeps what was asked).
        model, key = ctx.model if ctx.model_known else UNKNOWN, ctx.key_name
        self.requests.labels(model, str(ctx.status), key).inc()
        self.duration.labels(model, "true" if ctx.stream else "false").observe(ctx.duration_s)
        if ctx.ttft_s is not None:
            self.ttft.labels(model).observe(ctx.ttft_s)
        if ctx.itl_s is not None:
            self.itl.labels(model).observe(ctx.itl_s)
        if (timings := ctx.worker_timings) is not None:
            self.preprocess.labels(model).observe(timings.preprocess_s)
            self.queue.labels(model).observe(timings.queue_s)
            self.prefill.labels(model).observe(timings.prefill_s)
        if ctx.prompt_tokens:
            self.prompt_tokens.labels(model, key).inc(ctx.prompt_tokens)
        if ctx.completion_tokens:
            self.completion_tokens.labels(model, key).inc(ctx.completion_tokens)
        if ctx.cached_tokens:
            self.cached_tokens.labels(model, key).inc(ctx.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class WorkerCollector(Collector):
    """Per-model figures from each model's view and its worker's last heartbeat."""

    def __init__(self, workers: WorkerClient) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["model", *labels])

        info = gauge("mlxgw_model_info", "1 for each model, with its kind", "kind")
        state = gauge("mlxgw_model_state", "1 for the model's current state", "state")
        running = gauge("mlxgw_running_requests", "Requests generating in the worker")
        waiting = gauge("mlxgw_waiting_requests", "Requests queued in the worker")
        in_flight = gauge("mlxgw_in_flight_requests", "Requests the gateway holds for the model")
        rss = gauge("mlxgw_worker_resident_memory_bytes", "Worker process resident set")
        active = gauge("mlxgw_mlx_active_bytes", "MLX memory in live arrays")
        cache = gauge("mlxgw_mlx_cache_bytes", "MLX freed buffers kept for reuse")
        peak = gauge("mlxgw_mlx_peak_bytes", "MLX high-water mark of active memory")
        wired = gauge("mlxgw_mlx_wired_limit_bytes", "MLX memory the worker keeps resident")
        cache_limit = gauge("mlxgw_mlx_cache_limit_bytes", "Bound of MLX's buffer cache")
        load = gauge("mlxgw_model_load_seconds", "Load time of the current worker")
        restarts = CounterMetricFamily(
            "mlxgw_worker_restarts", "Workers restarted after a crash", labels=["model"]
        )
        generated = CounterMetricFamily(
            "mlxgw_generated_tokens",
            "Tokens the model's workers generated, counted as each step's output arrives "
            "(live; mlxgw_completion_tokens counts finished requests')",
            labels=["model"],
        )
        after_crash = CounterMetricFamily(
            "mlxgw_requests_after_crash",
            "Requests a worker's death touched: resumed from their tokens, replayed from the "
            "start, or failed with worker_died",
            labels=["model", "outcome"],
        )
        for view in self.workers.views():
            name, current = view.name, view.state
            for outcome, count in zip(
                ("resumed", "replayed", "failed"), view.after_crash, strict=True
            ):
                after_crash.add_metric([name, outcome], count)
            shown = view.info or view.last_info
            kind = kind_served(view.config, shown.capabilities if shown else None)
            info.add_metric([name, kind.value], 1.0)
            for s in ModelState:
                state.add_metric([name, s.value], 1.0 if s == current else 0.0)
            restarts.add_metric([name], view.restarts)
            generated.add_metric([name], view.generated_tokens)
            in_flight.add_metric([name], view.in_flight)
            hb = view.heartbeat
            running.add_metric([name], hb.running if hb else 0)
            waiting.add_metric([name], hb.waiting if hb else 0)
            if hb is not None:
                rss.add_metric([name], hb.memory_bytes)
                active.add_metric([name], hb.active_bytes)
                cache.add_metric([name], hb.cache_bytes)
                peak.add_metric([name], hb.peak_bytes)
                wired.add_metric([name], hb.wired_limit_bytes)
                cache_limit.add_metric([name], hb.cache_limit_bytes)
            if view.info is not None:
                load.add_metric([name], view.info.load_time_s)
        yield from (info, state, running, waiting, in_flight, rss, active, cache, peak, wired)
        yield from (cache_limit, load, restarts, generated, after_crash)
        yield from self.heartbeat_stats("prefix_cache", PREFIX_CACHE)
        yield from self.heartbeat_stats("prompt_segments", PROMPT_SEGMENTS)

    def heartbeat_stats(self, field: str, families: tuple[StatsFamily, ...]) -> Iterator[Metric]:
        """The current worker's figures of one of its heartbeat's stats Structs (`field`:
        also the metrics' prefix), as its last heartbeat reported them; no samples while it
        reports none. The worker counts from its start: counters that a new worker (a
        restart, a reload) resets, which Prometheus' rate() and increase() expect."""
        made = [
            (kind(f"mlxgw_{field}_{name}", doc, labels=["model"]), attr)
            for kind, name, doc, attr in families
        ]
        for view in self.workers.views():
            stats = getattr(view.heartbeat, field) if view.heartbeat is not None else None
            if stats is not None:
                for family, attr in made:
                    family.add_metric([view.name], getattr(stats, attr))
        yield from (family for family, _ in made)


@get("/metrics", include_in_schema=False)
async def metrics_route(state: State) -> Response[bytes]:
    metrics: Metrics = state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@get("/ready", include_in_schema=False)
async def ready_route(state: State) -> Response[dict[str, object]]:
    """Readiness: 200 while at least one model can serve, else 503 (same body shape)."""
    workers: WorkerClient = state.workers
    views = workers.views()
    ready = any(view.can_serve for view in views)
    body: dict[str, object] = {
        "status": "ready" if ready else "not_ready",
        "models": {view.name: view.state.value for view in views},
    }
    return Response(body, status_code=200 if ready else 503)
