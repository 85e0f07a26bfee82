"""Which of MLX's backends this worker process computes on."""

from __future__ import annotations

import mlx.core as mx


def on_cpu() -> bool:
    """Whether this process computes on MLX's CPU device."""
    return mx.default_device() == mx.cpu


def on_cuda() -> bool:
    """Whether this process's default device is a GPU under MLX's CUDA backend (mechanisms
    measured there, such as prefill buckets or the ragged-attention kernel, are on by default
    only here)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()
