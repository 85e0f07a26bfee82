"""gateway/api/relay.py: a stream paused for a new worker keeps its client's connection alive
(the SSE keep-alive, nothing else), and its reader goes on once output comes again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gateway.api.relay import Relay
from gateway.workers.client import PAUSE, WorkerClient
from gateway.workers.stream import RequestStream
from shared.types import FinishReason, RequestOutput, Usage

pytestmark = pytest.mark.anyio


class Plain:
    """A formatter that writes each delta's text as one line."""

    def stream_start(self, first: RequestOutput) -> bytes:
        return b"start\n"

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        return output.text.encode() + b"\n" if output.text else b""

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        return b"finish\n"

    def stream_end(self, usage: Usage) -> bytes:
        return b"end\n"

    def stream_error(self, error: Any) -> bytes:
        return b"error\n"

    def response(self, choices: Any, usage: Usage) -> bytes:
        return b"".join(c.text.encode() for c in choices)


def relay_of(stream: RequestStream) -> Relay:
    workers = cast(WorkerClient, SimpleNamespace(abort=lambda s: None))
    return Relay(workers, [stream], 60.0)


async def test_a_paused_stream_sends_its_keepalive_then_goes_on() -> None:
    stream = RequestStream("r", "m", "w")
    relay = relay_of(stream)
    stream.put(RequestOutput("r", text="a", token_ids=[1]))
    sent: list[bytes] = []

    async def read() -> None:
        async for chunk in relay.sse(Plain(), await relay.first(), b": resuming\n\n"):
            sent.append(chunk)

    reader = asyncio.create_task(read())
    while sent != [b"start\n", b"a\n"]:
        await asyncio.sleep(0)
    stream.nudge()  # not paused: nothing to say
    stream.paused = True  # its worker died
    for n in range(2):
        stream.nudge()
        while len(sent) < 3 + n:
            await asyncio.sleep(0)
    stream.nudge()
    stream.put(RequestOutput("r", text="b", token_ids=[2]))  # the continuation's output
    assert not stream.paused
    stream.put(RequestOutput("r", finish_reason=FinishReason.STOP, usage=Usage(1, 2)))
    await reader
    keepalive = b": resuming\n\n"
    assert sent == [b"start\n", b"a\n", keepalive, keepalive, b"b\n", b"finish\n", b"end\n"]


async def test_a_pause_adds_nothing_to_a_whole_response_or_a_finished_stream() -> None:
    stream = RequestStream("r", "m", "w")
    relay = relay_of(stream)
    stream.put(RequestOutput("r", text="a", token_ids=[1]))
    stream.paused = True
    collecting = asyncio.create_task(relay.collect(Plain()))
    while stream._pending is not None:
        await asyncio.sleep(0)
    stream.nudge()
    while stream._pending is PAUSE:
        await asyncio.sleep(0)
    stream.put(RequestOutput("r", text="b", token_ids=[2], finish_reason=FinishReason.STOP))
    assert await collecting == b"ab"
    stream.paused = True
    stream.nudge()  # finished: no pause to tell
    assert stream._pending is None
