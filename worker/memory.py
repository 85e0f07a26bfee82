"""What the worker's device can hold, and how much of it running requests' KV may take."""

from __future__ import annotations

import mlx.core as mx
import psutil

from shared.config import EngineOptions

GiB = 1 << 30
KV_HEADROOM = 0.9  # of what is left: activations, the buffer cache, fragmentation


def device_memory() -> int:
    """Bytes the device can hold: on a Mac the working set MLX recommends (part of the
    unified memory), under CUDA the GPU's memory, on MLX's CPU device the host's RAM."""
    if mx.default_device() != mx.cpu:
        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
            value = info.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return int(psutil.virtual_memory().total)


def kv_budget(options: EngineOptions) -> int:
    """Bytes for running requests' KV: `kv_memory_gb`, or what the device has left after
    what MLX holds now (the weights) and the prefix cache's bound, less a tenth."""
    if options.kv_memory_gb is not None:
        return int(options.kv_memory_gb * GiB)
    prefix = int(options.prefix_cache_gb * GiB) if options.prefix_cache else 0
    left = device_memory() - mx.get_active_memory() - prefix
    return max(GiB // 4, int(left * KV_HEADROOM))
