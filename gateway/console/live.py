"""The console's live figures: once a second, a sample per model of what `/metrics` exposes,
kept for the last ten minutes and pushed to the pages that watch.

One source of truth: every figure is read from the Metrics object's own collectors (the
ones a Prometheus scrape renders), never counted a second time. Per model and interval:
- tokens/s: the increase of `mlxgw_generated_tokens` (counted live, per step output);
- requests/s: the increase of `mlxgw_requests` (finished API requests);
- time to first token: the mean of `mlxgw_time_to_first_token_seconds` over the requests
  that finished in the interval (its sum's increase over its count's); None when none did;
- running and waiting: `mlxgw_running_requests` and `mlxgw_waiting_requests` now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.metrics_core import Metric

from gateway.edge.metrics import UNKNOWN, Metrics

log = logging.getLogger("gateway")

INTERVAL_S = 1.0
HISTORY = 600  # samples: ten minutes at one a second

Totals = dict[str, dict[str, float]]  # model -> figure -> value at one instant


def _add(totals: Totals, families: Iterable[Metric], wanted: dict[str, str]) -> None:
    """Sums samples by model: `wanted` maps a sample name to the figure it adds to."""
    for family in families:
        for sample in family.samples:
            figure = wanted.get(sample.name)
            model = sample.labels.get("model", UNKNOWN)
            if figure is not None and model != UNKNOWN:
                totals[model][figure] = totals[model].get(figure, 0.0) + sample.value


def _per_s(amount: float, elapsed: float) -> float:
    return amount / elapsed if elapsed > 0 else 0.0


class LiveFigures:
    """Samples the metrics every `interval` seconds (run() in the gateway's lifespan)."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        interval: float = INTERVAL_S,
        history: int = HISTORY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.interval = interval
        self.clock = clock
        self.samples: deque[dict[str, Any]] = deque(maxlen=history)
        self._last: tuple[float, Totals] | None = None
        self._watchers: set[asyncio.Queue[dict[str, Any]]] = set()

    def totals(self) -> Totals:
        """The cumulative and current figures per model, read from the collectors."""
        m = self.metrics
        totals: Totals = defaultdict(dict)
        _add(totals, m.worker_figures.collect(), LIVE_FIGURES)
        _add(totals, m.requests.collect(), {"mlxgw_requests_total": "requests"})
        _add(
            totals,
            m.ttft.collect(),
            {
                "mlxgw_time_to_first_token_seconds_sum": "ttft_sum",
                "mlxgw_time_to_first_token_seconds_count": "ttft_count",
            },
        )
        return totals

    def sample(self) -> dict[str, Any]:
        """Takes one sample now: rates over the time since the previous one."""
        now, totals = self.clock(), self.totals()
        models: dict[str, dict[str, float | None]] = {}
        previous = self._last
        for model, figures in totals.items():
            before = previous[1].get(model, {}) if previous else {}
            elapsed = now - previous[0] if previous else 0.0
            rise = {f: max(0.0, v - before.get(f, 0.0)) for f, v in figures.items()}
            # (max: a restarted worker's counter may start again from 0, never a negative rate)
            count = figures.get("ttft_count", 0.0) - before.get("ttft_count", 0.0)
            ttft = None
            if previous is not None and count > 0:
                ttft = (figures.get("ttft_sum", 0.0) - before.get("ttft_sum", 0.0)) / count
            models[model] = {
                "tokens_per_s": round(_per_s(rise.get("generated", 0.0), elapsed), 2),
                "requests_per_s": round(_per_s(rise.get("requests", 0.0), elapsed), 3),
                "ttft_s": None if ttft is None else round(ttft, 4),
                "running": figures.get("running", 0.0),
                "waiting": figures.get("waiting", 0.0),
            }
        self._last = (now, totals)
        point = {"t": round(now, 3), "models": models}
        self.samples.append(point)
        return point

    def history(self) -> list[dict[str, Any]]:
        return list(self.samples)

    def watch(self) -> asyncio.Queue[dict[str, Any]]:
        """A queue that gets each new sample (a slow reader loses the oldest)."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=8)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._watchers.discard(queue)

    def publish(self, point: dict[str, Any]) -> None:
        for queue in self._watchers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(point)

    async def run(self) -> None:
        """Samples on a steady beat until cancelled; a failing sample is logged, not fatal."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                self.publish(self.sample())
            except Exception:
                log.exception("console: sampling the metrics failed")
            next_at += self.interval
            next_at = max(next_at, loop.time())  # after a stall: no burst of catch-up samples
            await asyncio.sleep(next_at - loop.time())


# The worker collector's families the console reads: sample name -> figure
LIVE_FIGURES = {
    "mlxgw_generated_tokens_total": "generated",
    "mlxgw_running_requests": "running",
    "mlxgw_waiting_requests": "waiting",
}
