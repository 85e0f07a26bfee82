"""gateway/workers/control.py: a control call awaits its reply, times out, fails at once when
its worker dies, and carries a worker's refusal as the same 4xx."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from gateway.errors import GatewayError
from gateway.workers.control import ControlCalls
from gateway.workers.transport import Transport
from shared.protocol import Control, ControlReply
from shared.types import ErrorCode
from tests.worker_fakes import FakeTransport

pytestmark = pytest.mark.anyio


async def _call(
    calls: ControlCalls, transport: FakeTransport, timeout: float = 5.0
) -> asyncio.Task[dict[str, object]]:
    task = asyncio.create_task(
        calls.call(cast(Transport, transport), "w1", "m", "tokenize", {"x": 1}, timeout)
    )
    while not transport.sent and not task.done():  # until the frame has gone out
        await asyncio.sleep(0)
    return task


async def test_a_call_gets_its_own_reply() -> None:
    calls, transport = ControlCalls(), FakeTransport()
    first = await _call(calls, transport)
    transport.sent.clear()
    second = await _call(calls, transport)
    (_, frame) = transport.sent[0]
    assert isinstance(frame, Control) and frame.method == "tokenize" and frame.args == {"x": 1}
    calls.resolve(ControlReply("w2", 2, True, {"forged": 1}), "w2")  # not a call made to w2
    calls.resolve(ControlReply("w1", 2, True, {"tokens": [2]}), "w1")
    calls.resolve(ControlReply("w1", 1, True, {"tokens": [1]}), "w1")
    calls.resolve(ControlReply("w1", 99, True), "w1")  # nobody waits for it: ignored
    assert await first == {"tokens": [1]} and await second == {"tokens": [2]}


async def test_a_refusal_is_the_workers_error_with_its_param() -> None:
    calls, transport = ControlCalls(), FakeTransport()
    task = await _call(calls, transport)
    result = {"code": ErrorCode.INVALID_REQUEST.value, "param": "tokens"}
    refusal = ControlReply("w1", 1, False, result, "token id 9 is outside the vocabulary")
    calls.resolve(refusal, "w1")
    with pytest.raises(GatewayError) as err:
        await task
    assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.param == "tokens"
    assert "outside the vocabulary" in err.value.message


async def test_a_dead_worker_fails_its_calls_at_once() -> None:
    calls, transport = ControlCalls(), FakeTransport()
    task = await _call(calls, transport, timeout=60)
    calls.fail("other", "not this one")
    assert not task.done()
    calls.fail("w1", "the worker of model 'm' exited")
    with pytest.raises(GatewayError) as err:
        await task
    assert err.value.code == ErrorCode.WORKER_DIED


async def test_silence_is_a_timeout_and_an_unreachable_worker_a_503() -> None:
    calls, transport = ControlCalls(), FakeTransport()
    with pytest.raises(GatewayError) as err:
        await (await _call(calls, transport, timeout=0.01))
    assert err.value.code == ErrorCode.TIMEOUT and "did not answer tokenize" in err.value.message
    transport.reachable = False
    with pytest.raises(GatewayError) as err:
        await calls.call(cast(Transport, transport), "w1", "m", "stats", {}, 1)
    assert err.value.code == ErrorCode.WORKER_UNAVAILABLE
