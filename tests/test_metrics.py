"""/metrics and /ready through a real gateway, real workers and a tiny real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.context import RequestContext
from gateway.edge.metrics import Metrics
from gateway.workers.client import WorkerClient
from gateway.workers.slots import Slot
from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for
from tests.slot_fakes import SEGMENTS, STATS, heartbeat, ready_slot

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def gw(chat_model: Path) -> Iterator[GatewayProc]:
    model = {"name": "chat", "source": str(chat_model), "engine": {"buffer_cache_gb": 0.25}}
    with running_gateway([model]) as gw:
        yield gw


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(gw: GatewayProc) -> Samples:
    r = httpx.get(f"{gw.base_url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_request_metrics_move_by_the_right_amounts(gw: GatewayProc) -> None:
    client = openai_client(gw)
    before = scrape(gw)
    plain = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=6)
    chunks = list(
        client.chat.completions.create(
            model="chat",
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = chunks[-1].usage
    assert plain.usage is not None and streamed is not None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    after = scrape(gw)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("mlxgw_requests_total", model="chat", status="200", key="-") == 2
    # an unknown model's name is no label (callers could make up any number of them)
    assert moved("mlxgw_requests_total", model="-", status="404", key="-") == 1
    assert not any(("model", "nope") in labels for _, labels in after)
    completion = plain.usage.completion_tokens + streamed.completion_tokens
    assert moved("mlxgw_completion_tokens_total", model="chat", key="-") == completion
    # counted live, per step output, by the supervisor: the same tokens in the end
    assert moved("mlxgw_generated_tokens_total", model="chat") == completion
    prompt = plain.usage.prompt_tokens + streamed.prompt_tokens
    assert moved("mlxgw_prompt_tokens_total", model="chat", key="-") == prompt
    cached = sum(
        (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
        for u in (plain.usage, streamed)
    )
    assert moved("mlxgw_cached_prompt_tokens_total", model="chat", key="-") == cached
    assert moved("mlxgw_time_to_first_token_seconds_count", model="chat") == 2
    assert moved("mlxgw_inter_token_latency_seconds_count", model="chat") == 2
    assert moved("mlxgw_request_preprocess_seconds_count", model="chat") == 2
    assert moved("mlxgw_request_preprocess_seconds_sum", model="chat") > 0
    assert moved("mlxgw_request_queue_seconds_count", model="chat") == 2
    assert moved("mlxgw_request_prefill_seconds_count", model="chat") == 2
    assert moved("mlxgw_request_prefill_seconds_sum", model="chat") > 0
    assert moved("mlxgw_request_duration_seconds_count", model="chat", stream="true") == 1
    assert moved("mlxgw_request_duration_seconds_count", model="chat", stream="false") == 1
    # Scrapes and probes are not API requests.
    assert not any(
        k[0] == "mlxgw_requests_total" and {("model", "-"), ("status", "200")} <= k[1]
        for k in after
    )


def test_worker_gauges_come_from_the_supervisor(gw: GatewayProc) -> None:
    wait_for(lambda: value(scrape(gw), "mlxgw_mlx_active_bytes", model="chat") > 0, what="hb")
    samples = scrape(gw)
    assert value(samples, "mlxgw_model_state", model="chat", state="ready") == 1
    assert value(samples, "mlxgw_model_state", model="chat", state="failed") == 0
    assert ("mlxgw_running_requests", frozenset({("model", "chat")})) in samples
    assert ("mlxgw_waiting_requests", frozenset({("model", "chat")})) in samples
    assert value(samples, "mlxgw_worker_resident_memory_bytes", model="chat") > 0
    assert value(samples, "mlxgw_model_load_seconds", model="chat") > 0
    assert value(samples, "mlxgw_worker_restarts_total", model="chat") == 0
    for outcome in ("resumed", "replayed", "failed"):  # no worker of it died
        assert (
            value(samples, "mlxgw_requests_after_crash_total", model="chat", outcome=outcome) == 0
        )
    # the limits the worker set on MLX's memory: the configured buffer cache; no wired
    # memory off a Mac
    assert value(samples, "mlxgw_mlx_cache_limit_bytes", model="chat") == 2**28
    assert value(samples, "mlxgw_mlx_wired_limit_bytes", model="chat") == 0


def test_the_buffer_cache_goes_once_the_model_is_idle(gw: GatewayProc) -> None:
    """Requests leave freed buffers in MLX's cache; the worker hands them back once the model
    has been idle 2 s (worker/memory.py IdleRelease: the timing is unit-tested there)."""
    client = openai_client(gw)

    def kept_while_busy() -> bool:
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=16)
        return value(scrape(gw), "mlxgw_mlx_cache_bytes", model="chat") > 0

    wait_for(kept_while_busy, timeout=30, what="freed buffers after requests")
    wait_for(
        lambda: value(scrape(gw), "mlxgw_mlx_cache_bytes", model="chat") == 0,
        timeout=15,
        what="the buffer cache emptied once idle",
    )


def test_ready_with_a_ready_model(gw: GatewayProc) -> None:
    r = httpx.get(f"{gw.base_url}/ready", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "models": {"chat": "ready"}}


def test_not_ready_when_the_only_model_failed(chat_model: Path) -> None:
    faults = {"MLX_GATEWAY_FAULTS": json.dumps({"broken": {"probe_error": "no logits"}})}
    gw = GatewayProc([{"name": "broken", "source": str(chat_model)}], faults)
    try:

        def failed() -> bool:
            try:
                r = httpx.get(f"{gw.base_url}/health", timeout=2)
            except httpx.HTTPError:
                return False
            return bool(r.json()["models"].get("broken") == "failed")

        wait_for(failed, timeout=90, what="the model to fail")
        r = httpx.get(f"{gw.base_url}/ready", timeout=10)
        assert r.status_code == 503
        assert r.json() == {"status": "not_ready", "models": {"broken": "failed"}}
        assert httpx.get(f"{gw.base_url}/health", timeout=10).status_code == 200
    finally:
        gw.stop()


# ---- units: fake heartbeats, no model -----------------------------------------------------


def metrics_of(*slots: Slot) -> Metrics:
    workers = SimpleNamespace(views=lambda: [slot.view() for slot in slots])
    return Metrics(cast(WorkerClient, workers))


def test_prefix_cache_figures_come_from_the_last_heartbeat() -> None:
    metrics = metrics_of(ready_slot("chat", heartbeat(STATS)), ready_slot("plain", heartbeat()))
    text = metrics.render().decode()
    samples = parse(text)
    assert value(samples, "mlxgw_prefix_cache_bytes", model="chat") == STATS.nbytes
    assert value(samples, "mlxgw_prefix_cache_capacity_bytes", model="chat") == 2 * 2**30
    assert value(samples, "mlxgw_prefix_cache_entries", model="chat") == 12
    # The worker's running totals are counters (reset by a new worker), not gauges.
    assert "# TYPE mlxgw_prefix_cache_lookups_total counter" in text
    assert "# TYPE mlxgw_prefix_cache_bytes gauge" in text
    assert value(samples, "mlxgw_prefix_cache_lookups_total", model="chat") == 40
    assert value(samples, "mlxgw_prefix_cache_hits_total", model="chat") == 25
    assert value(samples, "mlxgw_prefix_cache_hit_tokens_total", model="chat") == 9000
    assert value(samples, "mlxgw_prefix_cache_evictions_total", model="chat") == 3
    assert value(samples, "mlxgw_prefix_cache_oversize_total", model="chat") == 2
    # A worker that reports no prefix cache (turned off) has no samples.
    plain = [k for k in samples if k[0].startswith("mlxgw_prefix_cache")]
    assert plain and all(("model", "chat") in labels for _, labels in plain)


def test_prompt_segment_figures_come_from_the_last_heartbeat() -> None:
    on = ready_slot("chat", heartbeat(STATS, SEGMENTS))
    metrics = metrics_of(on, ready_slot("whole", heartbeat(STATS)))
    text = metrics.render().decode()
    samples = parse(text)
    assert value(samples, "mlxgw_prompt_segments_entries", model="chat") == 30
    assert value(samples, "mlxgw_prompt_segments_bytes", model="chat") == 3_250_000
    assert value(samples, "mlxgw_prompt_segments_capacity_bytes", model="chat") == 32 * 2**20
    assert "# TYPE mlxgw_prompt_segments_bytes gauge" in text
    assert "# TYPE mlxgw_prompt_segments_hits_total counter" in text
    assert value(samples, "mlxgw_prompt_segments_prompts_total", model="chat") == 9
    assert value(samples, "mlxgw_prompt_segments_hits_total", model="chat") == 46
    assert value(samples, "mlxgw_prompt_segments_misses_total", model="chat") == 4
    assert value(samples, "mlxgw_prompt_segments_evictions_total", model="chat") == 2
    # A worker that reports no memo (segments off, or a model without them) has no samples.
    memo = [k for k in samples if k[0].startswith("mlxgw_prompt_segments")]
    assert len(memo) == 7 and all(("model", "chat") in labels for _, labels in memo)
    assert value(samples, "mlxgw_prefix_cache_hits_total", model="whole") == 25


def test_a_model_without_a_worker_has_no_prefix_cache_samples() -> None:
    slot = ready_slot("chat", heartbeat(STATS, SEGMENTS))
    slot.handle = None
    samples = parse(metrics_of(slot).render().decode())
    assert not any(name.startswith("mlxgw_prefix_cache") for name, _ in samples)
    assert not any(name.startswith("mlxgw_prompt_segments") for name, _ in samples)
    assert value(samples, "mlxgw_model_state", model="chat", state="unloaded") == 1


def test_cached_prompt_tokens_are_counted_per_model_and_key() -> None:
    metrics = metrics_of()
    ctx = RequestContext("r1", "POST", "/v1/chat/completions", model="chat", model_known=True)
    ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens = 20, 4, 16
    metrics.observe(ctx)
    metrics.observe(ctx)
    samples = parse(metrics.render().decode())
    assert value(samples, "mlxgw_cached_prompt_tokens_total", model="chat", key="-") == 32
    assert value(samples, "mlxgw_prompt_tokens_total", model="chat", key="-") == 40
