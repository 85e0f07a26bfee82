"""gateway/workers/liveness.py: silent and wedged workers are killed, loading ones are not."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.workers.liveness import Liveness, note_step, verdict
from gateway.workers.slots import WorkerHandle
from shared.config import ServerConfig
from shared.protocol import Heartbeat, WorkerState
from tests.worker_fakes import FakeProcess, chat, rig

pytestmark = pytest.mark.anyio


async def _ready_handle(tmp_path: Path) -> WorkerHandle:
    r = rig(tmp_path)
    await r.pool.load("m")
    return r.handle()


def _busy(handle: WorkerHandle, step: int) -> None:
    handle.heartbeat = Heartbeat(handle.worker_id, WorkerState.READY, step, 1, 3)


async def test_a_worker_silent_past_the_heartbeat_timeout_is_condemned(tmp_path: Path) -> None:
    handle = await _ready_handle(tmp_path)
    note_step(handle, 1, now=100.0)
    assert verdict(handle, 129.0, silence_s=30, wedge_s=300) is None
    assert "no heartbeat for 30s" in (verdict(handle, 131.0, 30, 300) or "")


async def test_an_engine_with_work_that_stops_stepping_is_wedged(tmp_path: Path) -> None:
    handle = await _ready_handle(tmp_path)
    _busy(handle, 5)
    note_step(handle, 5, now=100.0)
    for t in (110.0, 120.0, 130.0):  # heartbeats keep coming, the step stands still
        note_step(handle, 5, now=t)
    assert "engine stalled" in (verdict(handle, 131.0, silence_s=30, wedge_s=30) or "")
    note_step(handle, 6, now=131.0)  # it moved
    assert verdict(handle, 131.0, silence_s=30, wedge_s=30) is None


async def test_requests_sent_that_the_engine_never_takes_in_are_work(tmp_path: Path) -> None:
    # rank 0 of a sharded model waiting on a frozen rank: its heartbeats report nothing held
    r = rig(tmp_path)
    stream = await r.admission.submit(chat("a"))
    handle = r.handle()
    handle.heartbeat = Heartbeat(handle.worker_id, WorkerState.READY, 5, 0, 0)
    sent = handle.step_moved_at
    assert verdict(handle, sent + 29, silence_s=1e9, wedge_s=30) is None
    assert "engine stalled" in (verdict(handle, sent + 31, silence_s=1e9, wedge_s=30) or "")
    handle.streams.pop(stream.request_id)  # answered: idle again
    assert verdict(handle, sent + 31, silence_s=1e9, wedge_s=30) is None


async def test_a_request_after_a_long_rest_starts_the_stall_clock(tmp_path: Path) -> None:
    r = rig(tmp_path)
    await r.pool.load("m")
    handle = r.handle()
    note_step(handle, 5, now=time.monotonic() - 3600)  # idle an hour
    await r.admission.submit(chat("a"))
    _busy(handle, 5)  # taken in, in its first (long) prefill: the step has not moved yet
    assert verdict(handle, time.monotonic(), silence_s=1e9, wedge_s=30) is None


async def test_new_requests_do_not_hide_a_wedge(tmp_path: Path) -> None:
    # the engine holds requests whose clients left (their streams gone, the aborts never
    # taken in): a retry leased to it must not restart the stall clock
    r = rig(tmp_path)
    await r.pool.load("m")
    handle = r.handle()
    _busy(handle, 5)
    note_step(handle, 5, now=time.monotonic() - 3600)
    await r.admission.submit(chat("again"))
    assert "engine stalled" in (verdict(handle, time.monotonic(), 1e9, wedge_s=30) or "")


async def test_an_idle_engine_may_stand_still_and_a_loading_one_may_be_silent(
    tmp_path: Path,
) -> None:
    handle = await _ready_handle(tmp_path)
    handle.heartbeat = Heartbeat(handle.worker_id, WorkerState.READY, 5, 0, 0)
    note_step(handle, 5, now=100.0)
    assert verdict(handle, 200.0, silence_s=300, wedge_s=30) is None
    loading = WorkerHandle(handle.config, "w2", handle.process)  # no Ready yet
    assert verdict(loading, 1e9, silence_s=1, wedge_s=1) is None


async def test_a_sweep_kills_the_condemned_once(tmp_path: Path) -> None:
    handle = await _ready_handle(tmp_path)
    process = handle.process
    assert isinstance(process, FakeProcess)
    note_step(handle, 1, now=0.0)
    liveness = Liveness(ServerConfig(heartbeat_timeout_s=5))
    assert liveness.sweep([handle], now=10.0) == [handle]
    assert handle.killed and process.signals == [9]
    assert "no heartbeat" in (handle.error or "")
    assert liveness.sweep([handle], now=20.0) == []  # already killed: not again
    assert process.signals == [9]


async def test_the_watch_sweeps_until_cancelled(tmp_path: Path) -> None:
    handle = await _ready_handle(tmp_path)
    handle.last_seen = -1e9
    liveness = Liveness(ServerConfig(heartbeat_timeout_s=1))
    watch = asyncio.create_task(liveness.watch(lambda: [handle]))
    try:
        await asyncio.wait_for(_until_killed(handle), 5)
    finally:
        watch.cancel()


async def _until_killed(handle: WorkerHandle) -> None:
    while not handle.killed:
        await asyncio.sleep(0.01)
