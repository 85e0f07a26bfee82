"""Streaming load generator for an OpenAI-compatible /v1/chat/completions endpoint.

Closed loop: ``concurrency`` workers each send one request at a time until ``n`` requests
have been started or the level's deadline passes, so exactly ``concurrency`` requests are
in flight for most of the level. Only loopback URLs are accepted.

The client is aiohttp (C-accelerated HTTP parsing) on uvloop, as vLLM's serving benchmark
does: on a 2-core box the load generator shares the cores with the server, and with httpx it
took 0.14 of a core at 16 streams against 0.05 for aiohttp
(docs/lab/2026-11-cpu-serving-runs.md). For the same reason the stream is read a socket read
at a time (not a line at a time) and each event is decoded by msgspec into the few fields
measured: every cycle the client spends is one the server under test does not get.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import msgspec

from benchmarks._stats import RequestRecord

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def check_loopback(url: str) -> str:
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK and not host.startswith("127."):
        raise ValueError(f"refusing non-loopback target {url!r}: only 127.0.0.1 is allowed")
    return url.rstrip("/")


def make_client(max_connections: int, request_timeout: float) -> aiohttp.ClientSession:
    """Create inside the running event loop; use as ``async with``."""
    connector = aiohttp.TCPConnector(limit=max_connections + 8, keepalive_timeout=30.0)
    timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=30.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


def chat_body(
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    ignore_eos: bool,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streaming, greedy chat request: one user message, or a whole conversation."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    """The fields of a chat completion chunk that are measured (others are skipped)."""

    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode


def _has_content(event: _Event) -> bool:
    for choice in event.choices or ():
        delta = choice.delta
        if delta is not None and (delta.content or delta.reasoning_content or delta.reasoning):
            return True
    return False


class _Chunks(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


async def sse_data(content: _Chunks) -> AsyncIterator[tuple[float, list[bytes]]]:
    """(arrival time, the `data:` payloads of the complete SSE events in one socket read;
    `content` is aiohttp's StreamReader)."""
    pending = b""
    async for chunk in content.iter_any():
        now = time.perf_counter()
        pending += chunk
        if b"\r" in pending:  # CRLF framing, also when a read ends between \r and \n
            pending = pending.replace(b"\r\n", b"\n")
        *events, pending = pending.split(b"\n\n")
        payloads = [
            line[5:].strip()
            for event in events
            for line in event.split(b"\n")
            if line.startswith(b"data:")
        ]
        if payloads:
            yield now, payloads


async def one_request(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    max_tokens: int,
    deadline: float,
) -> RequestRecord:
    """Send one streaming request; never raises (errors land in the record)."""
    rec = RequestRecord(start=time.perf_counter())
    usage: dict[str, Any] | None = None
    finish = None
    try:
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            rec.status = resp.status
            if resp.status != 200:
                detail = (await resp.read())[:200].decode("utf-8", "replace")
                rec.error = f"http_{resp.status}: {detail}"
                return rec
            done = False
            async for now, payloads in sse_data(resp.content):
                if now > deadline:
                    rec.error = "deadline: request exceeded the level deadline"
                    return rec
                for data in payloads:
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        event = _decode_event(data)
                    except msgspec.DecodeError:
                        rec.error = f"bad_json: {data[:80]!r}"
                        return rec
                    if event.error is not None and not event.choices:
                        rec.error = f"stream_error: {str(event.error)[:160]}"
                        return rec
                    if _has_content(event):
                        rec.chunk_times.append(now)
                    for choice in event.choices or ():
                        finish = choice.finish_reason or finish
                    if event.usage:
                        usage = event.usage
                if done:
                    break
    except TimeoutError as e:
        rec.error = f"timeout: {type(e).__name__}"
    except aiohttp.ClientError as e:
        rec.error = f"connection: {type(e).__name__} {e}"[:200]
    except (OSError, asyncio.IncompleteReadError) as e:
        rec.error = f"connection: {type(e).__name__} {e}"[:200]
    finally:
        rec.end = time.perf_counter()
    if rec.error is not None:
        return rec
    if usage is None:
        # No usage chunk: fall back to counting content chunks, and call it a failure.
        rec.completion_tokens = len(rec.chunk_times)
        rec.error = "no_usage: server sent no usage chunk"
        return rec
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    if not rec.chunk_times:
        rec.error = "empty: no content chunks"
    elif (rec.completion_tokens or 0) < max_tokens:
        rec.error = f"short: {rec.completion_tokens} < {max_tokens} tokens (finish={finish})"
    else:
        rec.ok = True
    return rec


async def run_level(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    prompts: Sequence[str],
    concurrency: int,
    max_tokens: int,
    ignore_eos: bool,
    level_timeout: float,
    extra: dict[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run ``len(prompts)`` requests with ``concurrency`` in flight; returns records, wall."""
    records: list[RequestRecord] = []
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + level_timeout

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(prompts) and time.perf_counter() < deadline:
            prompt = prompts[next_index]
            next_index += 1
            body = chat_body(model, prompt, max_tokens, ignore_eos, extra)
            records.append(await one_request(client, url, body, max_tokens, deadline))

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=level_timeout + 30.0)
    except TimeoutError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = (max(r.end for r in records) if records else time.perf_counter()) - t0
    skipped = len(prompts) - next_index
    for _ in range(skipped):
        records.append(RequestRecord(start=t0, end=t0, error="not_started: level deadline"))
    return records, wall


async def served_model(client: aiohttp.ClientSession, url: str, prefer: str | None) -> str:
    """The model id to send: ``prefer`` if given, else the last id listed by /v1/models.

    mlx_lm's server lists the Hugging Face cache first and its own ``--model`` last, and
    its listing fails outright (after a 200 header) when there is no cache; it also maps
    the id ``default_model`` to its ``--model``, so that is the fallback.
    """
    if prefer:
        return prefer
    try:
        async with client.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(10.0)) as resp:
            listing = await resp.json(content_type=None)
        ids = [m.get("id") for m in listing.get("data", []) if m.get("id")]
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        ids = []
    return ids[-1] if ids else "default_model"


async def warm_up(
    client: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
) -> RequestRecord:
    body = chat_body(model, prompt, max_tokens, ignore_eos=True)
    return await one_request(client, url, body, max_tokens, time.perf_counter() + 300.0)


# The gateway's own account of its requests (its /metrics histograms, seconds summed over
# requests and their count), as the mean each gives over a level: where first tokens waited
# in the worker (preparing, queued, prefilling), and the first token and the time between
# tokens as the gateway saw them (against the client's figures: what the way from the
# gateway to the client adds). Other servers have no such metrics.
GATEWAY_MEANS = {
    "mlxgw_request_preprocess_seconds": "preprocess_mean_ms",
    "mlxgw_request_queue_seconds": "queue_mean_ms",
    "mlxgw_request_prefill_seconds": "prefill_mean_ms",
    "mlxgw_time_to_first_token_seconds": "gateway_ttft_mean_ms",
    "mlxgw_inter_token_latency_seconds": "gateway_itl_mean_ms",
}


async def gateway_account(client: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """{metric_sum: ..., metric_count: ...} for GATEWAY_MEANS, summed over models (empty
    before a model's first request); None when the server has no /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with client.get(url + "/metrics", timeout=aiohttp.ClientTimeout(10.0)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in GATEWAY_MEANS:
                continue
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:
        return None
    return totals


def gateway_means(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """GATEWAY_MEANS' milliseconds over the requests between two scrapes."""
    if before is None or not after:
        return {}
    means = {}
    for metric, key in GATEWAY_MEANS.items():
        count = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        total = after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)
        if count > 0:
            means[key] = round(1000 * total / count, 1)
    return means
