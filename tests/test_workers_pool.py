"""gateway/workers/pool.py: single-flight loads, drains on unload, zero-downtime reloads,
and the worker for a request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.errors import GatewayError
from gateway.workers.client import ModelState
from shared.config import ModelConfig
from shared.protocol import Shutdown, ShutdownMode
from shared.types import (
    ErrorCode,
    FinishReason,
    RequestOutput,
)
from tests.worker_fakes import chat, rig, until

pytestmark = pytest.mark.anyio


async def test_concurrent_loads_start_one_worker(tmp_path: Path) -> None:
    r = rig(tmp_path)
    slots = await asyncio.gather(*(r.pool.load("m") for _ in range(5)))
    assert len(r.processes.spawned) == 1
    assert all(slot.state == ModelState.READY for slot in slots)
    await r.pool.load("m")  # loaded: nothing new
    assert len(r.processes.spawned) == 1


async def test_a_load_that_outlives_its_timeout_is_a_503(tmp_path: Path) -> None:
    r = rig(tmp_path, load_timeout_s=0.05)
    r.processes.auto_ready = False
    with pytest.raises(GatewayError) as err:
        await r.pool.load("m")
    assert err.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert "server.load_timeout_s=0.05s" in err.value.message


async def test_unload_drains_the_worker_and_reports_whether_it_was_loaded(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path)
    assert await r.pool.unload("m") is False
    await r.pool.load("m")
    handle = r.handle()
    assert await r.pool.unload("m", timeout=7) is True
    assert r.transport.frames(Shutdown) == [Shutdown(ShutdownMode.DRAIN, 7)]
    assert handle.exited.is_set() and r.catalog.slot("m").state == ModelState.UNLOADED


async def test_a_forced_unload_asks_the_worker_to_abort(tmp_path: Path) -> None:
    r = rig(tmp_path)
    await r.pool.load("m")
    await r.pool.unload("m", force=True, timeout=1)
    assert r.transport.frames(Shutdown)[0].mode == ShutdownMode.ABORT


async def test_a_reload_swaps_workers_once_the_new_one_is_ready(tmp_path: Path) -> None:
    r = rig(tmp_path)
    await r.pool.load("m")
    old = r.handle()
    stream = await r.admission.submit(chat("old"))
    new = await r.pool.reload("m")
    assert r.handle() is new and new is not old
    await until(lambda: old.worker_id in r.processes.draining)  # told to drain
    assert old.retiring and not old.exited.is_set()  # its request still runs
    r.output(old, RequestOutput(stream.request_id, finish_reason=FinishReason.STOP))
    await until(lambda: old.exited.is_set())
    assert r.catalog.slot("m").state == ModelState.READY


async def test_the_worker_for_a_request_is_loaded_on_demand(tmp_path: Path) -> None:
    r = rig(tmp_path)
    slot = r.catalog.slot("m")
    handle = await r.pool.acquire(slot)
    assert handle is slot.handle and slot.state == ModelState.READY


async def test_a_model_that_refuses_to_load_on_demand_is_a_503_naming_the_command(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, ModelConfig(name="m", source="/nowhere", on_demand="refuse"))
    with pytest.raises(GatewayError, match="gatewayctl load m") as err:
        await r.pool.acquire(r.catalog.slot("m"))
    assert err.value.retry_after == 30
    assert not r.processes.spawned


async def test_loading_over_the_memory_budget_evicts_the_idle_model(tmp_path: Path) -> None:
    models = [ModelConfig(name=n, source="/nowhere", memory_gb=6) for n in ("a", "b")]
    r = rig(tmp_path, *models, memory_budget_gb=10)
    await r.pool.load("a")
    await r.pool.load("b")
    assert r.catalog.slot("a").state == ModelState.UNLOADED
    assert r.catalog.slot("b").state == ModelState.READY
