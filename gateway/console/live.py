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
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.metrics_core import Metric

from gateway.edge.metrics import UNKNOWN, Metrics
from gateway.errors import GatewayError
from shared.types import ErrorCode

log = logging.getLogger("gateway")

INTERVAL_S = 1.0
HISTORY = 600  # samples: ten minutes at one a second
QUEUE = 8  # samples a stream may fall behind before it is dropped
MAX_WATCHERS = 64  # open live streams, in all
MAX_PER_KEY = 8  # ... and per key (the open gateway's streams count as one key's)

Totals = dict[str, dict[str, float]]  # model -> figure -> value at one instant
Watch = asyncio.Queue[dict[str, Any] | None]


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
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        max_watchers: int = MAX_WATCHERS,
        max_per_key: int = MAX_PER_KEY,
    ) -> None:
        self.metrics = metrics
        self.interval = interval
        self.clock = clock  # rates: a wall-clock step must not skew them
        self.wall = wall  # each sample's time, for the charts
        self.max_watchers = max_watchers
        self.max_per_key = max_per_key
        self.samples: deque[dict[str, Any]] = deque(maxlen=history)
        self._last: tuple[float, Totals] | None = None
        self._watchers: dict[Watch, str] = {}  # each open stream's queue: its key's id

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
        point = {"t": round(self.wall(), 3), "models": models}
        self.samples.append(point)
        return point

    def history(self) -> list[dict[str, Any]]:
        return list(self.samples)

    def watch(self, owner: str = "") -> Watch:
        """A queue that gets each new sample, for a stream opened with key `owner` ("": no
        key). Refused (503) past the bounds on open streams, in all and per key."""
        mine = sum(1 for o in self._watchers.values() if o == owner)
        if len(self._watchers) >= self.max_watchers or mine >= self.max_per_key:
            raise GatewayError(
                ErrorCode.OVERLOADED,
                f"too many open console streams ({mine} for this key, "
                f"{len(self._watchers)} in all); close some of the console's tabs",
                retry_after=5,
            )
        queue: Watch = asyncio.Queue(maxsize=QUEUE)
        self._watchers[queue] = owner
        return queue

    def unwatch(self, queue: Watch) -> None:
        self._watchers.pop(queue, None)

    @property
    def watching(self) -> int:
        return len(self._watchers)

    def publish(self, point: dict[str, Any]) -> None:
        """Each watcher gets the sample; one that has not read for QUEUE samples (a client
        that stopped taking its stream) is dropped: it finds None next, and its stream ends."""
        for queue in list(self._watchers):
            if queue.full():
                self.unwatch(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)
            else:
                queue.put_nowait(point)

    @staticmethod
    async def next(queue: Watch) -> dict[str, Any] | None:
        """The next sample; None once the watcher was dropped."""
        return await queue.get()

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
