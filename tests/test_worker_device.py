"""worker/device.py: which of MLX's backends a worker computes on (the gateway's detection,
without mlx, is tests/test_device.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from worker.device import on_cpu, on_cuda


@pytest.mark.parametrize(
    ("device", "cuda", "expected"),
    [
        (mx.gpu, True, True),  # MLX's CUDA backend
        (mx.gpu, False, False),  # Metal
        (mx.cpu, True, False),  # a CUDA build computing on its CPU
        (mx.cpu, False, False),
    ],
)
def test_on_cuda_needs_the_gpu_under_the_cuda_backend(
    monkeypatch: pytest.MonkeyPatch, device: mx.DeviceType, cuda: bool, expected: bool
) -> None:
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(device))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    assert on_cuda() is expected


@pytest.mark.parametrize("device", [mx.cpu, mx.gpu])
def test_on_cpu_is_the_default_device(
    monkeypatch: pytest.MonkeyPatch, device: mx.DeviceType
) -> None:
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(device))
    assert on_cpu() is (device == mx.cpu)
