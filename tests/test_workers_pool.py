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


async def test_a_reload_whose_old_worker_dies_meanwhile_takes_what_waited(
    tmp_path: Path,
) -> None:
    """The old worker crashes while the new one loads (its restart still backing off): the
    new one serves, with the request the crash left waiting, and the restart is off."""
    r = rig(tmp_path, restart_backoff_s=0.5)
    await r.pool.load("m")
    old, slot = r.handle(), r.catalog.slot("m")
    held = await r.admission.submit(chat("held"))
    r.processes.auto_ready = False
    reload = asyncio.ensure_future(r.pool.reload("m"))
    await until(lambda: len(r.processes.spawned) == 2)
    new = r.processes.spawned[1]
    r.processes.exit(old, -9)
    assert slot.restarting and held in slot.replay
    r.processes.make_ready(new)
    assert await reload is new
    assert r.handle() is new and not slot.restarting and held.request_id in new.streams
    await asyncio.sleep(0.6)  # the crash's restart wakes, and finds nothing to do
    assert len(r.processes.spawned) == 2 and slot.state == ModelState.READY
    fresh = await r.admission.submit(chat("fresh"))
    assert fresh.request_id in new.streams and old not in slot.retiring


async def test_a_reload_overtaken_by_the_restart_keeps_one_worker(tmp_path: Path) -> None:
    """The crash's restart starts a worker before the reload's is ready: the reload's goes,
    and the reload answers with the restart's."""
    r = rig(tmp_path, restart_backoff_s=0.01)
    await r.pool.load("m")
    old = r.handle()
    r.processes.auto_ready = False
    reload = asyncio.ensure_future(r.pool.reload("m"))
    await until(lambda: len(r.processes.spawned) == 2)
    new = r.processes.spawned[1]
    r.processes.exit(old, -9)
    await until(lambda: len(r.processes.spawned) == 3)  # the restart's worker
    third = r.processes.spawned[2]
    r.processes.make_ready(new)
    await until(lambda: new.exited.is_set())  # not needed: ended
    r.processes.make_ready(third)
    assert await reload is third and r.handle() is third
    await r.pool.unload("m")
    assert third.exited.is_set()


async def test_an_unload_under_an_on_demand_load_is_a_503(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.processes.auto_ready = False
    waiter = asyncio.ensure_future(r.admission.submit(chat("x")))
    await until(lambda: len(r.processes.spawned) == 1)
    await r.pool.unload("m")
    with pytest.raises(GatewayError, match="was unloaded while it was loading") as err:
        await waiter
    assert err.value.code == ErrorCode.WORKER_UNAVAILABLE and err.value.retry_after == 2


async def test_a_restart_that_cannot_spawn_fails_the_model_and_its_waiters(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, restart_backoff_s=0.01)
    await r.pool.load("m")
    waiting = await r.admission.submit(chat("w"))

    async def no_descriptors(model: ModelConfig, restart: bool) -> None:
        raise OSError(24, "Too many open files")

    r.processes.spawn = no_descriptors  # type: ignore[assignment,method-assign]
    r.processes.exit(r.handle(), -9)
    slot = r.catalog.slot("m")
    await until(lambda: waiting.finished)
    assert not slot.restarting and slot.state == ModelState.FAILED
    assert "Too many open files" in (slot.error or "")
