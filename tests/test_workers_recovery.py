"""gateway/workers/recovery.py: crashes replay what had not started, fail what had, back off
exponentially, and a crash loop fails the model; expected exits end their requests cleanly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.errors import GatewayError
from gateway.workers.client import ModelState
from gateway.workers.recovery import backoff_s
from gateway.workers.slots import Slot
from gateway.workers.slots import status_row as slot_row
from gateway.workers.stream import PAUSE
from shared.config import ServerConfig
from shared.protocol import Add
from shared.types import (
    ErrorCode,
    FinishReason,
    RequestOutput,
)
from tests.worker_fakes import chat, rig, until

pytestmark = pytest.mark.anyio


def serving(slot: Slot) -> bool:
    """Ready, and done restarting: what waited for the new worker has been sent to it."""
    return slot.state == ModelState.READY and not slot.restarting


def test_backoff_doubles_per_recent_crash_up_to_its_cap() -> None:
    server = ServerConfig(restart_backoff_s=0.5, restart_backoff_max_s=3)
    assert [backoff_s(server, n) for n in range(1, 6)] == [0.5, 1, 2, 3, 3]


async def test_a_crash_replays_unstarted_requests_and_resumes_started_ones(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, restart_backoff_s=0.01)
    await r.pool.load("m")
    first = r.handle()
    started = await r.admission.submit(chat("started"))
    waiting = await r.admission.submit(chat("waiting"))
    started.put(RequestOutput("started", text="Hel", token_ids=[1]))
    started.put(RequestOutput("started", text="lo", token_ids=[7]))
    r.processes.exit(first, -9)  # SIGKILL
    slot = r.catalog.slot("m")
    assert slot.state == ModelState.LOADING and slot.restarting
    assert [s.request_id for s in slot.replay] == ["waiting", "started"]
    assert not started.finished and started.resumes == 1
    await until(lambda: serving(slot))
    second = r.handle()
    assert second is not first and second.restart and slot.restarts == 1
    assert set(second.streams) == {"waiting", "started"}
    adds = {
        a.request_id: a for w, a in r.transport.sent if isinstance(a, Add) and w == second.worker_id
    }
    assert adds["waiting"].request.resumed == []  # replayed as it was sent the first time
    assert adds["started"].request.resumed == [1, 7]  # goes on from the tokens received
    assert adds["started"].request.messages == started.add.request.messages  # type: ignore[union-attr]
    assert slot.last_error == "the worker exited (killed by SIGKILL)"
    assert not waiting.finished


async def test_a_paused_stream_hears_of_its_pause_until_its_next_worker_makes_output(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, restart_backoff_s=0.3)
    r.recovery.pause_keepalive_s = 0.01
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    stream = await r.admission.submit(chat("s"))
    r.output(r.handle(), RequestOutput("s", text="a", token_ids=[1]))
    assert (await stream.get()).text == "a"
    r.processes.exit(r.handle(), -9)
    assert stream.paused
    assert await stream.get() is PAUSE  # while the new worker comes up
    await until(lambda: serving(slot))
    r.output(r.handle(), RequestOutput("s", text="b", token_ids=[2]))
    assert not stream.paused
    outputs = [await stream.get()]
    while outputs[-1] is PAUSE:  # a nudge may have come just before the output
        outputs.append(await stream.get())
    assert outputs[-1].text == "b"


async def test_a_request_resumed_resume_max_times_ends_with_worker_died(tmp_path: Path) -> None:
    r = rig(tmp_path, restart_backoff_s=0.01, resume_max=2)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    stream = await r.admission.submit(chat("poison"))
    for death in range(3):
        stream.put(RequestOutput("poison", text="a", token_ids=[death]))
        r.processes.exit(r.handle(), 1)
        if death < 2:
            assert not stream.finished and stream.resumes == death + 1
            await until(lambda: serving(slot))
    outputs = []
    while not outputs or outputs[-1].finish_reason is None:
        outputs.append(await stream.get())
    error = outputs[-1].error
    assert error is not None and error.code == ErrorCode.WORKER_DIED
    assert "resumed 2 times and its worker died with it again" in error.message
    assert "resume_max=2" in error.message


async def test_a_poison_request_is_found_and_failed_alone_while_the_others_go_on(
    tmp_path: Path,
) -> None:
    """A request whose continuation kills every worker it reaches: the death it causes
    with everyone is shared, then the suspects are tried singly and only it is charged."""
    r = rig(tmp_path, restart_backoff_s=0.001, resume_max=2, crash_loop_count=10)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    streams = {rid: await r.admission.submit(chat(rid)) for rid in ("a", "poison", "b")}
    for rid in streams:
        r.output(r.handle(), RequestOutput(rid, text="x", token_ids=[1]))
    r.processes.exit(r.handle(), -9)  # nobody on trial: all three share it
    assert [s.strikes for s in streams.values()] == [1, 1, 1]
    await until(lambda: serving(slot))
    assert set(r.handle().streams) == {"a", "poison", "b"}  # together, each on trial
    assert all(s.probation for s in streams.values())
    r.processes.exit(r.handle(), -9)  # on trial together: nobody is charged
    assert [s.strikes for s in streams.values()] == [1, 1, 1]
    assert all(s.alone for s in streams.values())
    deaths = 2
    while not streams["poison"].finished:
        await until(
            lambda: slot.state == ModelState.READY and any(s.probation for s in streams.values())
        )
        handle = r.handle()
        trial = [rid for rid, s in streams.items() if s.probation]
        if trial != ["poison"]:  # the others first, together once they were tried alone
            assert "poison" not in trial
            for rid in trial:
                r.output(handle, RequestOutput(rid, text="y", token_ids=[2]))
            continue
        r.processes.exit(handle, 1)  # the poison's continuation: it alone was on trial
        deaths += 1
    error = (await streams["poison"].get()).error
    assert error is not None and error.code == ErrorCode.WORKER_DIED
    assert "it may be what kills the worker" in error.message
    assert streams["poison"].strikes == 3 and deaths == 4
    assert slot.died == 1 and slot.resumed == 3 + 3 + 2 + 2 and not slot.replayed
    # the others, charged once, went on together (they were tried alone already)
    await until(lambda: slot.state == ModelState.READY and len(r.handle().streams) == 2)
    for rid in ("a", "b"):
        assert streams[rid].strikes == 1 and streams[rid].probation
        r.output(r.handle(), RequestOutput(rid, text="z", token_ids=[3]))
        r.output(r.handle(), RequestOutput(rid, finish_reason=FinishReason.STOP))
        outputs = [await streams[rid].get()]
        assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].error is None
    assert not any(s.alone for s in streams.values())


async def test_suspects_sent_singly_do_not_hold_back_new_requests_or_aborted_ones(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, restart_backoff_s=0.001)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    first = await r.admission.submit(chat("first"))
    second = await r.admission.submit(chat("second"))
    r.processes.exit(r.handle(), -9)
    await until(lambda: serving(slot))
    r.processes.exit(r.handle(), -9)  # both on trial: singly from now on
    assert first.alone and second.alone
    await until(lambda: slot.state == ModelState.READY and bool(r.handle().streams))
    (trial,) = r.handle().streams
    new = await r.admission.submit(chat("new"))  # not a suspect: sent at once
    assert set(r.handle().streams) == {trial, "new"} and not new.probation
    r.admission.abort(first if trial == "first" else second)  # its client left
    await until(lambda: len(r.handle().streams) == 2 and trial not in r.handle().streams)
    assert not slot.replay


async def test_with_resume_max_0_the_request_that_had_output_ends_with_worker_died(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, restart_backoff_s=0.01, resume_max=0)
    await r.pool.load("m")
    stream = await r.admission.submit(chat("x"))
    stream.put(RequestOutput("x", text="a", token_ids=[1]))
    r.processes.exit(r.handle(), 1)
    outputs = []
    while not outputs or outputs[-1].finish_reason is None:
        outputs.append(await stream.get())
    last = outputs[-1]
    assert last.finish_reason == FinishReason.ERROR
    assert last.error is not None and last.error.code == ErrorCode.WORKER_DIED
    assert "exit status 1" in last.error.message


async def test_a_request_whose_second_worker_dies_too_is_not_sent_a_third_time(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, restart_backoff_s=0.01)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    poison = await r.admission.submit(chat("poison"))
    r.processes.exit(r.handle(), 1)
    await until(lambda: serving(slot))
    assert list(r.handle().streams) == ["poison"] and not poison.finished  # replayed once
    innocent = await r.admission.submit(chat("innocent"))
    r.processes.exit(r.handle(), 1)
    last = await poison.get()
    assert last.finish_reason == FinishReason.ERROR and last.error is not None
    assert last.error.code == ErrorCode.WORKER_DIED
    assert "second worker to die" in last.error.message
    assert [s.request_id for s in slot.replay] == ["innocent"]  # its first crash: replayed
    await until(lambda: serving(slot))
    assert list(r.handle().streams) == ["innocent"] and not innocent.finished


async def test_suspects_waiting_to_be_tried_alone_go_on_after_a_reload(tmp_path: Path) -> None:
    """Two requests on probation at a death wait to be tried one at a time; a reload
    meanwhile must not strand the one not yet sent."""
    r = rig(tmp_path, restart_backoff_s=0.01, crash_loop_count=10)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    a, b = await r.admission.submit(chat("a")), await r.admission.submit(chat("b"))
    r.processes.exit(r.handle(), -9)  # both sent again, on probation
    await until(lambda: serving(slot))
    r.processes.exit(r.handle(), -9)  # two suspects: each tried alone next
    await until(lambda: serving(slot))
    first = r.handle()
    [tried] = first.streams
    new = await r.pool.reload("m")
    r.output(first, RequestOutput(tried, text="x", token_ids=[1], finish_reason=FinishReason.STOP))
    waiting = b if tried == "a" else a
    await until(lambda: waiting.request_id in new.streams)
    assert not slot.replay


async def test_a_crash_loop_backs_the_model_off_then_it_restarts_by_itself(
    tmp_path: Path,
) -> None:
    r = rig(
        tmp_path,
        restart_backoff_s=0.001,
        crash_loop_count=3,
        crash_backoff_s=0.3,
        crash_backoff_max_s=0.6,
    )
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    for _ in range(3):
        await until(lambda: serving(slot))
        r.processes.exit(r.handle(), -11)
    assert slot.state == ModelState.BACKOFF and slot.error is None
    assert slot.last_error is not None
    assert slot.last_error.startswith("crash loop: 3 crashes within 120s")
    assert "SIGSEGV" in slot.last_error
    row = slot_row(slot, -1, time.monotonic())
    assert row["state"] == "backoff" and 0 < row["next_attempt_s"] <= 0.3  # type: ignore[operator]
    with pytest.raises(GatewayError) as refused:  # a request meanwhile: 503, Retry-After
        await r.admission.submit(chat("during"))
    assert refused.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert refused.value.retry_after == 1 and "backing off" in refused.value.message
    await until(lambda: slot.state == ModelState.READY, timeout=5)  # by itself
    assert slot.loops == 1 and not slot.crashes
    for _ in range(3):  # a second loop in a row: twice as long
        await until(lambda: serving(slot))
        r.processes.exit(r.handle(), -11)
    assert slot.state == ModelState.BACKOFF and slot.loops == 2
    assert 0.3 < slot_row(slot, -1, time.monotonic())["next_attempt_s"] <= 0.6  # type: ignore[operator]
    await r.pool.load("m")  # an explicit load does not wait for the backoff
    assert slot.state == ModelState.READY


async def test_a_worker_that_made_output_starts_the_crash_count_over(tmp_path: Path) -> None:
    """Killed from outside while serving (or by a poison request): not a broken model. Its
    crashes neither grow the restart delay nor make a crash loop."""
    r = rig(tmp_path, restart_backoff_s=0.01, restart_backoff_max_s=10, crash_loop_count=3)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    for n in range(5):
        await until(lambda: serving(slot))
        stream = await r.admission.submit(chat(f"r{n}"))
        r.output(r.handle(), RequestOutput(f"r{n}", text="x", token_ids=[1]))
        r.processes.exit(r.handle(), -9)
        assert slot.state == ModelState.LOADING and len(slot.crashes) == 1 and not stream.finished
    await until(lambda: serving(slot))
    r.processes.exit(r.handle(), -9)  # this one made nothing: the second crash in a row
    assert len(slot.crashes) == 2 and slot.state == ModelState.LOADING


async def test_a_failed_restart_is_a_crash_and_the_next_one_is_scheduled(tmp_path: Path) -> None:
    r = rig(tmp_path, restart_backoff_s=0.01, crash_loop_count=5)
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    r.processes.fail_load = "import error"
    r.processes.exit(r.handle(), 1)
    await until(lambda: len(slot.crashes) >= 3)
    r.processes.fail_load = None
    await until(lambda: slot.state in (ModelState.READY, ModelState.FAILED))
    assert slot.state == ModelState.READY
    assert slot.last_error == "import error"


async def test_an_unload_ends_the_requests_of_the_worker_it_retires(tmp_path: Path) -> None:
    r = rig(tmp_path)
    await r.pool.load("m")
    handle = r.handle()
    stream = await r.admission.submit(chat("x"))
    handle.retiring = True
    r.processes.exit(handle, 0)
    out = await stream.get()
    assert out.error is not None and out.error.code == ErrorCode.SHUTTING_DOWN
    assert not r.catalog.slot("m").crashes


async def test_a_worker_that_never_got_ready_is_a_load_failure_not_a_crash(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path)
    r.processes.fail_load = "no such model"
    with pytest.raises(Exception, match="no such model"):
        await r.pool.load("m")
    slot = r.catalog.slot("m")
    assert slot.state == ModelState.FAILED and slot.error == "no such model"
    assert not slot.crashes and not slot.restarting
