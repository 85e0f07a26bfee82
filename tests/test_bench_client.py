"""The benchmark client's SSE reader: events split across socket reads, CRLF, comments."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from benchmarks import _client
from benchmarks._client import _decode_event, _has_content, sse_data


class _Reads:
    """Stands for aiohttp's StreamReader: one `iter_any` item per socket read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk


async def _read(chunks: list[bytes]) -> list[list[bytes]]:
    return [payloads async for _, payloads in sse_data(_Reads(chunks))]


def test_events_split_across_reads_are_joined_and_crlf_is_accepted() -> None:
    chunks = [
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choi',
        b'ces":[{"delta":{"content":"b"}}]}\r\n\r\n: a comment\n\n',
        b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n',
    ]
    reads = asyncio.run(_read(chunks))
    assert reads == [
        [b'{"choices":[{"delta":{"content":"a"}}]}'],
        [b'{"choices":[{"delta":{"content":"b"}}]}'],
        [b'{"choices":[],"usage":{"completion_tokens":2}}', b"[DONE]"],
    ]


def test_crlf_split_between_reads_still_ends_the_event() -> None:
    reads = asyncio.run(_read([b"data: 1\r\n\r", b"\ndata: 2\r", b"\n\r\n"]))
    assert reads == [[b"1"], [b"2"]]


def test_only_chunks_with_text_count_as_content() -> None:
    def event(body: str) -> Any:
        return _decode_event(body.encode())

    assert _has_content(event('{"choices":[{"delta":{"content":"x"}}],"id":"c","object":"o"}'))
    assert _has_content(event('{"choices":[{"delta":{"reasoning_content":"x"}}]}'))
    assert not _has_content(event('{"choices":[{"delta":{"role":"assistant","content":""}}]}'))
    assert not _has_content(event('{"choices":[{"delta":{},"finish_reason":"length"}]}'))
    assert not _has_content(event('{"choices":null,"usage":{"prompt_tokens":1}}'))
    assert event('{"error":{"message":"boom"}}').error == {"message": "boom"}


def test_gateway_means_are_of_the_requests_between_two_scrapes() -> None:
    before = {
        "mlxgw_request_preprocess_seconds_sum": 0.01,
        "mlxgw_request_preprocess_seconds_count": 10.0,
        "mlxgw_request_queue_seconds_sum": 1.0,
        "mlxgw_request_queue_seconds_count": 10.0,
        "mlxgw_request_prefill_seconds_sum": 2.0,
        "mlxgw_request_prefill_seconds_count": 10.0,
        "mlxgw_inter_token_latency_seconds_sum": 0.05,
        "mlxgw_inter_token_latency_seconds_count": 10.0,
    }
    after = {
        "mlxgw_request_preprocess_seconds_sum": 0.02,
        "mlxgw_request_preprocess_seconds_count": 15.0,
        "mlxgw_request_queue_seconds_sum": 1.5,
        "mlxgw_request_queue_seconds_count": 15.0,
        "mlxgw_request_prefill_seconds_sum": 2.25,
        "mlxgw_request_prefill_seconds_count": 15.0,
        "mlxgw_inter_token_latency_seconds_sum": 0.075,
        "mlxgw_inter_token_latency_seconds_count": 15.0,
    }
    assert _client.gateway_means(before, after) == {
        "preprocess_mean_ms": 2.0,
        "queue_mean_ms": 100.0,
        "prefill_mean_ms": 50.0,
        "gateway_itl_mean_ms": 5.0,
    }
    assert _client.gateway_means(None, after) == {}  # a server without the metrics
    assert _client.gateway_means(before, before) == {}  # no request in between
    first = {k: v - before[k] for k, v in after.items()}  # the first requests of a model
    assert _client.gateway_means({}, first) == _client.gateway_means(before, after)
