"""The console's live figures: rates and means read from the metrics' own collectors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.console.live import LiveFigures
from gateway.console.recent import RecentRequests
from gateway.edge.context import RequestContext
from gateway.edge.keys import ApiKey
from gateway.edge.metrics import Metrics
from gateway.errors import GatewayError
from tests.slot_fakes import heartbeat, ready_slot


class Views:
    """The workers' client as the collectors read it: views of ready slots."""

    def __init__(self, *names: str) -> None:
        self.slots = {name: ready_slot(name, heartbeat()) for name in names}

    def views(self) -> list[Any]:
        return [slot.view() for slot in self.slots.values()]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finished(model: str, path: str = "/v1/chat/completions", ttft: float = 0.2) -> RequestContext:
    ctx = RequestContext("r", "POST", path, model=model, model_known=bool(model), status=200)
    ctx.started = 10.0
    ctx.first_token_at = 10.0 + ttft
    ctx.last_token_at = ctx.finished_at = 11.0
    ctx.completion_tokens = 5
    return ctx


def setup(*names: str) -> tuple[Views, Metrics, LiveFigures, Clock]:
    views = Views(*names)
    metrics = Metrics(views)  # type: ignore[arg-type]
    clock = Clock()
    return views, metrics, LiveFigures(metrics, clock=clock, wall=clock), clock


def test_rates_are_increases_over_the_time_between_samples() -> None:
    views, metrics, live, clock = setup("a", "b")
    views.slots["a"].generated_tokens = 100
    first = live.sample()
    assert first["models"]["a"]["tokens_per_s"] == 0.0  # no interval yet
    assert first["models"]["a"]["ttft_s"] is None
    views.slots["a"].generated_tokens = 400
    metrics.observe(finished("a", ttft=0.1))
    metrics.observe(finished("a", ttft=0.3))
    clock.now += 2.0
    second = live.sample()["models"]
    assert second["a"]["tokens_per_s"] == 150.0
    assert second["a"]["requests_per_s"] == 1.0
    assert abs(second["a"]["ttft_s"] - 0.2) < 1e-9  # the mean of the interval's requests
    assert second["a"]["running"] == 1.0 and second["a"]["waiting"] == 0.0
    assert second["b"]["tokens_per_s"] == 0.0 and second["b"]["ttft_s"] is None
    clock.now += 1.0
    third = live.sample()["models"]["a"]
    assert third["ttft_s"] is None and third["tokens_per_s"] == 0.0  # nothing new


def test_the_figures_are_what_metrics_renders() -> None:
    """One source: the sample's cumulative inputs are the /metrics text's values."""
    views, metrics, live, _ = setup("a")
    views.slots["a"].generated_tokens = 42
    metrics.observe(finished("a"))
    totals = live.totals()["a"]
    text = metrics.render().decode()
    assert 'mlxgw_generated_tokens_total{model="a"} 42.0' in text
    assert totals["generated"] == 42.0 and totals["requests"] == 1.0
    assert 'mlxgw_time_to_first_token_seconds_count{model="a"} 1.0' in text
    assert totals["ttft_count"] == 1.0


def test_requests_before_a_model_was_named_and_other_paths_are_left_out() -> None:
    _, metrics, live, _ = setup("a")
    metrics.observe(finished(""))  # a 401 before the body named a model
    metrics.observe(finished("a", path="/metrics"))
    assert set(live.totals()) == {"a"}
    assert live.totals()["a"].get("requests", 0.0) == 0.0


def test_a_counter_that_starts_again_gives_no_negative_rate() -> None:
    views, _, live, clock = setup("a")
    views.slots["a"].generated_tokens = 500
    live.sample()
    views.slots["a"].generated_tokens = 0  # a slot counts across workers; still: never < 0
    clock.now += 1
    assert live.sample()["models"]["a"]["tokens_per_s"] == 0.0


def test_history_is_bounded_and_watchers_get_each_sample() -> None:
    _, metrics, _, clock = setup("a")
    live = LiveFigures(metrics, history=3, clock=clock, wall=clock)
    queue = live.watch()
    for _ in range(5):
        clock.now += 1
        live.publish(live.sample())
    assert len(live.history()) == 3 and live.history()[-1]["t"] == clock.now
    assert queue.qsize() == 5
    live.unwatch(queue)
    live.publish(live.sample())
    assert queue.qsize() == 5


def test_a_watcher_that_stops_reading_is_dropped_and_told() -> None:
    _, _, live, clock = setup("a")
    slow, quick = live.watch("k"), live.watch("k")
    for i in range(9):
        clock.now = 2000.0 + i
        live.publish(live.sample())
        quick.get_nowait()
    assert live.watching == 1  # the slow one fell 8 behind: dropped, its queue says so
    assert slow.get_nowait() is None and slow.empty()


def test_rates_follow_the_monotonic_clock_not_the_wall() -> None:
    views, metrics, _, clock = setup("a")
    wall = Clock()
    live = LiveFigures(metrics, clock=clock, wall=wall)
    live.sample()
    views.slots["a"].generated_tokens = 50
    clock.now += 1.0
    wall.now -= 3600  # the wall clock stepped back an hour
    point = live.sample()
    assert point["models"]["a"]["tokens_per_s"] == 50.0 and point["t"] == wall.now


def test_open_streams_are_bounded_in_all_and_per_key() -> None:
    _, metrics, _, _ = setup("a")
    live = LiveFigures(metrics, max_watchers=3, max_per_key=2)
    live.watch("k1"), live.watch("k1")
    with pytest.raises(GatewayError) as per_key:
        live.watch("k1")
    assert per_key.value.status == 503 and per_key.value.retry_after == 5
    live.watch("k2")
    with pytest.raises(GatewayError):
        live.watch("k3")  # 3 in all
    assert live.watching == 3


def test_run_samples_on_a_beat_until_cancelled() -> None:
    _, metrics, _, _ = setup("a")
    live = LiveFigures(metrics, interval=0.01)

    async def go() -> int:
        queue = live.watch()
        task = asyncio.create_task(live.run())
        for _ in range(3):
            await asyncio.wait_for(queue.get(), 5)
        task.cancel()
        return len(live.history())

    assert asyncio.run(go()) >= 3


def key(key_id: str, name: str) -> ApiKey:
    return ApiKey(id=key_id, name=name, hash="0" * 64, created_at=0.0)


def test_recent_requests_keep_figures_only_newest_first() -> None:
    recent = RecentRequests(keep=3)
    for i in range(4):
        ctx = finished("a")
        ctx.request_id, ctx.key = f"r{i}", key("k1" if i % 2 else "k2", f"name{i % 2}")
        ctx.prompt_tokens, ctx.cached_tokens = 20, 16
        recent.observe(ctx)
    recent.observe(finished("a", path="/console/api/state"))  # not an API request
    rows = recent.latest()
    assert [r["id"] for r in rows] == ["r3", "r2", "r1"]
    top = rows[0]
    assert top["model"] == "a" and top["key"] == "name1" and top["status"] == 200
    assert (top["prompt_tokens"], top["cached_tokens"], top["completion_tokens"]) == (20, 16, 5)
    assert top["ttft_s"] == 0.2 and top["duration_s"] == 1.0
    assert not {"text", "prompt", "messages", "output"} & set(top)
    assert [r["id"] for r in recent.latest(key_id="k1")] == ["r3", "r1"]
    assert [r["id"] for r in recent.latest(after=rows[1]["seq"])] == ["r3"]
    assert [r["id"] for r in recent.latest(limit=1)] == ["r3"]
