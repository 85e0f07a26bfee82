"""The memory budget's size: the device's memory, corrected by a worker's Ready."""

from __future__ import annotations

import logging

import pytest

from gateway.device import Device
from gateway.memory import MemoryBudget
from shared.config import ServerConfig
from shared.protocol import Capacity, Ready

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
    caplog.set_level(logging.INFO, "gateway.supervisor")
    budget = MemoryBudget(ServerConfig(), HOST)
    budget.observe(ready("gpu", 80 * GiB))
    assert (budget.total, budget.budget, budget.source) == (80 * GiB, 60 * GiB, "worker (gpu)")
    assert "80.0 GiB on the worker's gpu (was 16.0 GiB from host RAM)" in caplog.text


def test_ready_without_device_memory_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gateway.supervisor")
    budget = MemoryBudget(ServerConfig(), H200)
    budget.observe(ready("", 0))  # a worker from before the field
    budget.observe(ready("gpu", 140 * GiB))  # the same figure: nothing to log
    assert (budget.total, budget.budget, budget.source) == (140 * GiB, 105 * GiB, "nvidia-smi")
    assert not caplog.text
