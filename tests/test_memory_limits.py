"""The limits a worker sets on MLX's memory (worker/memory.py), on a fake Metal device and
on this machine's CPU device."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import psutil
import pytest

from shared.config import EngineOptions
from shared.protocol import PromptSegmentStats, WorkerState
from worker import memory

GiB = 1 << 30


class FakeMLX:
    def __init__(self, metal: bool, working_set: int | None) -> None:
        self.metal = metal
        self.info = {} if working_set is None else {"max_recommended_working_set_size": working_set}
        self.calls: list[tuple[str, int]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(mx.metal, "is_available", lambda: self.metal)
        monkeypatch.setattr(mx, "device_info", lambda: self.info)
        for name in ("set_wired_limit", "set_cache_limit"):
            monkeypatch.setattr(mx, name, self._record(name))

    def _record(self, name: str) -> Any:
        def call(value: int) -> int:
            self.calls.append((name, value))
            return 0

        return call


def test_a_mac_wires_its_working_set_and_bounds_the_buffer_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeMLX(metal=True, working_set=96 * GiB)
    fake.install(monkeypatch)
    limits = memory.own_memory(EngineOptions())
    assert limits == memory.MemoryLimits(96 * GiB, 4 * GiB)
    assert fake.calls == [("set_wired_limit", 96 * GiB), ("set_cache_limit", 4 * GiB)]


def test_a_small_mac_keeps_an_eighth_and_a_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMLX(metal=True, working_set=16 * GiB)
    fake.install(monkeypatch)
    assert memory.own_memory(EngineOptions()).cache_bytes == 2 * GiB
    assert memory.own_memory(EngineOptions(buffer_cache_gb=0.5)).cache_bytes == GiB // 2


def test_under_cuda_the_buffer_cache_keeps_a_quarter_of_the_gpu_and_a_setting_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeMLX(metal=False, working_set=None)
    fake.install(monkeypatch)
    fake.info = {"total_memory": 80 * GiB}
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert memory.own_memory(EngineOptions()) == memory.MemoryLimits(0, 20 * GiB)
    assert memory.own_memory(EngineOptions(buffer_cache_gb=2.0)).cache_bytes == 2 * GiB
    assert fake.calls == [("set_cache_limit", 20 * GiB), ("set_cache_limit", 2 * GiB)]


def test_elsewhere_only_a_setting_changes_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMLX(metal=False, working_set=None)
    fake.install(monkeypatch)
    assert memory.own_memory(EngineOptions()) == memory.MemoryLimits(0, 0)
    assert fake.calls == []
    assert memory.own_memory(EngineOptions(buffer_cache_gb=1.0)) == memory.MemoryLimits(0, GiB)
    assert fake.calls == [("set_cache_limit", GiB)]


def test_the_prefix_cache_default_follows_the_device_and_leaves_the_kv_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeMLX(metal=True, working_set=48 * GiB)  # a 64 GB Mac
    fake.install(monkeypatch)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 16 * GiB)  # an 8B model's weights
    assert memory.prefix_cache_bound(EngineOptions()) == 6 * GiB
    assert memory.prefix_cache_bound(EngineOptions(prefix_cache_gb=1.0)) == GiB
    assert memory.kv_budget(EngineOptions()) == int((48 - 16 - 6) * GiB * memory.KV_HEADROOM)
    off = EngineOptions(prefix_cache=False)
    assert memory.kv_budget(off) == int((48 - 16) * GiB * memory.KV_HEADROOM)


def test_on_this_machine_it_runs_against_real_mlx() -> None:
    limits = memory.own_memory(EngineOptions())
    assert limits == memory.MemoryLimits(0, 0)  # Linux: MLX's CPU or CUDA device
    assert memory.kv_budget(EngineOptions(kv_memory_gb=2.0)) == 2 * GiB
    assert memory.kv_budget(EngineOptions()) >= GiB // 4


def test_the_buffer_cache_goes_once_per_idle_spell_and_not_between_requests() -> None:
    idle = memory.IdleRelease(after_s=2.0)
    assert not idle.due(busy=False, now=0.0)  # nothing ran yet: nothing to release
    assert not idle.due(busy=True, now=1.0)
    assert not idle.due(busy=False, now=1.1)  # a gap between two requests
    assert not idle.due(busy=True, now=1.2)
    assert not idle.due(busy=False, now=1.5)
    assert not idle.due(busy=False, now=3.4)  # idle 1.9 s
    assert idle.due(busy=False, now=3.6)  # idle 2.1 s: release
    assert not idle.due(busy=False, now=10.0)  # once per spell
    assert not idle.due(busy=True, now=11.0)
    assert not idle.due(busy=False, now=11.5)
    assert idle.due(busy=False, now=13.5)


def test_a_heartbeat_carries_the_limits_and_the_prompt_memo() -> None:
    where = (WorkerState.LOADING, "loading weights", 0.5)
    limits = memory.MemoryLimits(GiB, GiB // 2)
    memo = PromptSegmentStats(3, 600, 4_000_000, 2, 5, 4, 1)
    hb = memory.heartbeat("w1", where, None, limits, psutil.Process(), memo)
    assert (hb.state, hb.stage, hb.progress, hb.step, hb.running) == (*where, 0, 0)
    assert (hb.wired_limit_bytes, hb.cache_limit_bytes) == (GiB, GiB // 2)
    assert hb.prompt_segments == memo and hb.prefix_cache is None and hb.memory_bytes > 0
    assert memory.heartbeat("w1", where, None, limits, psutil.Process()).prompt_segments is None
