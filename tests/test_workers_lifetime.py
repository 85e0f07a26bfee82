"""gateway/workers/lifetime.py: the idle TTL starts when the last request leaves and stops
when the next arrives; a request's keep_alive overrides the model's ttl."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.workers.client import ModelState
from shared.config import ModelConfig
from shared.types import (
    FinishReason,
    RequestOutput,
)
from tests.worker_fakes import chat, rig, until

pytestmark = pytest.mark.anyio


async def test_an_idle_model_unloads_when_its_ttl_runs_out(tmp_path: Path) -> None:
    r = rig(tmp_path, ModelConfig(name="m", source="/nowhere", ttl="50ms"))
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    assert slot.idle_since is not None  # loaded and idle: the TTL runs
    await until(lambda: slot.state == ModelState.UNLOADED)


async def test_a_request_in_flight_holds_the_model_and_its_end_restarts_the_ttl(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, ModelConfig(name="m", source="/nowhere", ttl="50ms"))
    await r.pool.load("m")
    stream = await r.admission.submit(chat())
    slot = r.catalog.slot("m")
    assert slot.idle_timer is None and slot.idle_since is None
    handle = r.handle()
    r.output(handle, RequestOutput(stream.request_id, finish_reason=FinishReason.STOP))
    assert slot.idle_timer is not None
    await until(lambda: slot.state == ModelState.UNLOADED)


async def test_keep_alive_overrides_the_ttl_and_a_negative_one_keeps_the_model(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, ModelConfig(name="m", source="/nowhere", ttl="1h"))
    await r.pool.load("m")
    slot = r.catalog.slot("m")
    assert r.lifetime.ttl_of(slot) == 3600
    stream = await r.admission.submit(chat(keep_alive=-1.0))
    r.output(r.handle(), RequestOutput(stream.request_id, finish_reason=FinishReason.STOP))
    assert r.lifetime.ttl_of(slot) == -1
    assert slot.idle_timer is None  # never expires


async def test_the_server_default_applies_when_the_model_sets_none(tmp_path: Path) -> None:
    r = rig(tmp_path, default_ttl="5m")
    assert r.lifetime.ttl_of(r.catalog.slot("m")) == 300
