"""The memory budget's size (the device's memory, corrected by a worker's Ready) and a
model's estimate (weights, prefix cache)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.workers.device import Device
from gateway.workers.memory import MemoryBudget
from gateway.workers.slots import estimate_bytes
from shared.config import EngineOptions, ModelConfig, ServerConfig
from shared.protocol import Capacity, Ready
from tests.slot_fakes import ready_slot

GiB = 2**30
H200 = Device("gpu", "cuda", 140 * GiB, "nvidia-smi")
HOST = Device("cpu", "cpu", 16 * GiB, "host RAM")


def ready(device: str, memory: int) -> Ready:
    return Ready("w-1", Capacity(64, 256, 4096), device=device, device_memory_bytes=memory)


def test_budget_is_three_quarters_of_the_device() -> None:
    budget = MemoryBudget(ServerConfig(), H200)
    assert (budget.total, budget.budget, budget.source) == (140 * GiB, 105 * GiB, "nvidia-smi")
    assert MemoryBudget(ServerConfig(), HOST).budget == 12 * GiB


def test_memory_budget_gb_wins() -> None:
    budget = MemoryBudget(ServerConfig(memory_budget_gb=1.6), H200)
    assert budget.budget == int(1.6 * GiB)
    budget.observe(ready("gpu", 80 * GiB))
    assert budget.budget == int(1.6 * GiB) and budget.total == 80 * GiB


def test_ready_corrects_the_detected_memory(caplog: pytest.LogCaptureFixture) -> None:
    # Planned for the CPU (nvidia-smi missing); the worker runs on an 80 GB GPU.
    caplog.set_level(logging.INFO, "gateway.workers.supervisor")
    budget = MemoryBudget(ServerConfig(), HOST)
    budget.observe(ready("gpu", 80 * GiB))
    assert (budget.total, budget.budget, budget.source) == (80 * GiB, 60 * GiB, "worker (gpu)")
    assert "80.0 GiB on the worker's gpu (was 16.0 GiB from host RAM)" in caplog.text


def test_ready_without_device_memory_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gateway.workers.supervisor")
    budget = MemoryBudget(ServerConfig(), H200)
    budget.observe(ready("", 0))  # a worker from before the field
    budget.observe(ready("gpu", 140 * GiB))  # the same figure: nothing to log
    assert (budget.total, budget.budget, budget.source) == (140 * GiB, 105 * GiB, "nvidia-smi")
    assert not caplog.text


# ---- a model's estimate -----------------------------------------------------------------


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4000)
    (tmp_path / "config.json").write_text("{}")  # not weights
    return tmp_path


def model(source: str, memory_gb: float | None = None, **engine: object) -> ModelConfig:
    options = EngineOptions(**engine)  # type: ignore[arg-type]
    return ModelConfig(name="m", source=source, memory_gb=memory_gb, engine=options)


def test_estimate_counts_the_prefix_cache_bound(weights: Path) -> None:
    assert estimate_bytes(model(str(weights)), 16 * GiB) == 5000 + 2 * GiB  # the floor
    assert estimate_bytes(model(str(weights)), 80 * GiB) == 5000 + 10 * GiB  # an eighth
    assert estimate_bytes(model(str(weights), prefix_cache_gb=0.5), 80 * GiB) == 5000 + GiB // 2
    assert estimate_bytes(model(str(weights), prefix_cache=False), 80 * GiB) == 5000


def test_estimate_before_the_weights_are_known() -> None:
    assert estimate_bytes(model("org/not-downloaded"), 140 * GiB) == 140 * GiB // 8
    assert estimate_bytes(model("org/not-downloaded", prefix_cache=False), 140 * GiB) == 0


def test_the_budget_counts_the_default_bound_on_its_device(weights: Path) -> None:
    """A worker's Ready that corrects the device's memory also corrects the estimate of the
    models on it (their prefix caches' default bound follows the device)."""
    loaded = ready_slot("m")  # a worker with no heartbeat yet: its model's estimate counts
    loaded.config = model(str(weights))
    budget = MemoryBudget(ServerConfig(), HOST)
    assert budget.used([loaded]) == 5000 + 2 * GiB
    budget.observe(ready("gpu", 80 * GiB))
    assert budget.used([loaded]) == 5000 + 10 * GiB


def test_memory_gb_is_the_whole_estimate(weights: Path) -> None:
    assert estimate_bytes(model(str(weights), memory_gb=1.0), 80 * GiB) == GiB
    assert estimate_bytes(model(str(weights), memory_gb=1.0, prefix_cache_gb=8.0), 80 * GiB) == GiB
