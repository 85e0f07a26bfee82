"""gateway/workers/admission.py: refusals before anything is sent, queues while a model
restarts, idempotent aborts, and capabilities."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.errors import GatewayError
from gateway.workers import admission
from gateway.workers.client import Submission
from shared.protocol import Abort, Add, Capacity
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    Message,
    RequestKind,
    SamplingParams,
)
from tests.worker_fakes import chat, rig

pytestmark = pytest.mark.anyio


async def test_a_request_is_leased_to_the_worker_and_sent(tmp_path: Path) -> None:
    r = rig(tmp_path)
    stream = await r.admission.submit(chat("a"))
    handle = r.handle()
    assert handle.streams == {"a": stream} and stream.worker_id == handle.worker_id
    (add,) = r.transport.frames(Add)
    assert add.request_id == "a" and add.kind == RequestKind.CHAT
    assert r.catalog.slot("m").served == 1


async def test_a_full_queue_is_a_429_with_retry_after(tmp_path: Path) -> None:
    r = rig(tmp_path, capacity=Capacity(max_running=2, max_waiting=1, max_context=4096))
    for i in range(3):  # 2 running + 1 waiting
        await r.admission.submit(chat(str(i)))
    with pytest.raises(GatewayError) as err:
        await r.admission.submit(chat("3"))
    assert err.value.code == ErrorCode.OVERLOADED and err.value.retry_after == 1
    assert "3 requests in flight" in err.value.message


async def test_the_gateway_shutting_down_refuses_new_requests(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.draining.append(True)
    with pytest.raises(GatewayError) as err:
        await r.admission.submit(chat("a"))
    assert err.value.code == ErrorCode.SHUTTING_DOWN
    assert not r.processes.spawned  # nothing loaded for it


async def test_an_unreachable_worker_leaves_no_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admission, "DEATH_WAIT_S", 0.05)
    r = rig(tmp_path)
    await r.pool.load("m")
    r.transport.reachable = False  # and it does not exit
    with pytest.raises(GatewayError, match="unreachable"):
        await r.admission.submit(chat("a"))
    assert r.handle().streams == {}


async def test_a_worker_dead_before_the_gateway_saw_it_go_queues_the_request(
    tmp_path: Path,
) -> None:
    """A kill -9 lands between admission and the send: the socket refuses the request,
    the exit follows, and the request waits for the next worker, as one arriving while the
    model restarts does (not a 503)."""
    r = rig(tmp_path, restart_backoff_s=60)
    await r.pool.load("m")
    handle = r.handle()
    r.transport.reachable = False
    asyncio.get_running_loop().call_later(0.01, r.processes.exit, handle, -9)
    stream = await r.admission.submit(chat("a"))
    slot = r.catalog.slot("m")
    assert slot.replay == [stream] and stream.worker_id == "" and handle.streams == {}
    assert slot.served == 1


async def test_an_unencodable_value_is_a_400_and_leaves_no_lease(tmp_path: Path) -> None:
    r = rig(tmp_path)
    await r.pool.load("m")
    r.transport.send = lambda *_: (_ for _ in ()).throw(OverflowError("int too big"))  # type: ignore[method-assign]
    with pytest.raises(GatewayError) as err:
        await r.admission.submit(chat("a"))
    assert err.value.code == ErrorCode.INVALID_REQUEST and "int too big" in err.value.message
    assert r.handle().streams == {}


async def test_while_a_model_restarts_requests_queue_for_its_next_worker(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, max_queued=1, restart_backoff_s=60)
    await r.pool.load("m")
    r.processes.exit(r.handle(), -9)
    slot = r.catalog.slot("m")
    queued = await r.admission.submit(chat("q"))
    assert slot.replay == [queued] and queued.worker_id == ""
    with pytest.raises(GatewayError) as err:
        await r.admission.submit(chat("q2"))
    assert err.value.code == ErrorCode.OVERLOADED
    r.admission.abort(queued)  # leaves the queue, nothing to tell a worker
    assert slot.replay == [] and not r.transport.frames(Abort)


async def test_abort_tells_the_worker_once(tmp_path: Path) -> None:
    r = rig(tmp_path)
    stream = await r.admission.submit(chat("a"))
    r.admission.abort(stream)
    r.admission.abort(stream)
    assert r.transport.frames(Abort) == [Abort(["a"])]
    assert r.handle().streams == {}


async def test_a_model_without_a_capability_is_a_400_naming_the_field(tmp_path: Path) -> None:
    r = rig(tmp_path)
    await r.pool.load("m")  # the fake's Ready: chat and completion only
    with pytest.raises(GatewayError) as err:
        await r.admission.submit(
            Submission(
                "m",
                RequestKind.CHAT,
                CanonicalRequest(messages=[Message("user", "hi")]),
                SamplingParams(logprobs=True),
                needs=("chat", "logprobs"),
            )
        )
    assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.param == "logprobs"
    assert not r.transport.frames(Add)


async def test_a_template_variable_that_is_a_templating_argument_is_refused(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path)
    request = CanonicalRequest(
        messages=[Message("user", "hi")], chat_template_kwargs={"tokenize": True}
    )
    with pytest.raises(GatewayError) as err:
        await r.admission.submit(Submission("m", RequestKind.CHAT, request, SamplingParams()))
    assert err.value.param == "chat_template_kwargs.tokenize"
