"""What the worker's device can hold, how much of it running requests' KV may take, and the
limits the worker sets on MLX's memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import psutil

from shared.config import EngineOptions
from shared.engine_options import prefix_cache_bytes
from shared.protocol import Heartbeat, PromptSegmentStats, WorkerState
from worker.device import on_cuda

GiB = 1 << 30
KV_HEADROOM = 0.9  # of what is left: activations, the buffer cache, fragmentation
MAC_BUFFER_CACHE = 4 * GiB  # at most, and at most an eighth of the working set
# Under CUDA, the share of the GPU's memory the buffer cache may keep: the rest of what MLX
# does not hold stays the driver's (CUDA graphs, cuBLAS's workspaces). Unbounded, a worker
# serving prefills at ever new shapes filled an H100 with cached buffers and died in
# cudaGraphInstantiate ("out of memory"; docs/benchmarks.md).
CUDA_BUFFER_CACHE_SHARE = 4
# The buffer cache goes back to the system once the engine has had no work this long: not
# between one request and the next (the next would allocate every buffer again), only when
# the model sits idle.
IDLE_RELEASE_S = 2.0


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    wired_bytes: int = 0  # kept resident (0: none set)
    cache_bytes: int = 0  # the buffer cache's bound (0: MLX's default)


def own_memory(options: EngineOptions) -> MemoryLimits:
    """Set MLX's memory limits for this worker. On a Mac (Metal): wire the recommended
    working set, so that a large model's weights are not paged out between requests (as
    mlx-lm's server does), and bound the buffer cache (`buffer_cache_gb`, default the smaller
    of 4 GiB and an eighth of the working set); the worker empties it once the model is
    idle (IdleRelease). Under CUDA the buffer cache keeps at most a quarter of the GPU's
    memory (CUDA_BUFFER_CACHE_SHARE) unless `buffer_cache_gb` says otherwise; on MLX's CPU
    device only an explicit `buffer_cache_gb` is applied."""
    cache = int(options.buffer_cache_gb * GiB) if options.buffer_cache_gb else 0
    if not mx.metal.is_available():
        if not cache and on_cuda():
            cache = device_memory() // CUDA_BUFFER_CACHE_SHARE
        if cache:
            mx.set_cache_limit(cache)
        return MemoryLimits(0, cache)
    working = int(mx.device_info().get("max_recommended_working_set_size", 0) or 0)
    if working:
        mx.set_wired_limit(working)
    cache = cache or min(MAC_BUFFER_CACHE, working // 8)
    if cache:
        mx.set_cache_limit(cache)
    return MemoryLimits(working, cache)


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


def prefix_cache_bound(options: EngineOptions) -> int:
    """The prefix cache's bound in bytes on this worker's device (`prefix_cache_gb`, or by
    default a share of the device's memory: shared/engine_options.py)."""
    return prefix_cache_bytes(options, device_memory())


def kv_budget(options: EngineOptions) -> int:
    """Bytes for running requests' KV: `kv_memory_gb`, or what the device has left after
    what MLX holds now (the weights) and the prefix cache's bound, less a tenth."""
    if options.kv_memory_gb is not None:
        return int(options.kv_memory_gb * GiB)
    prefix = prefix_cache_bound(options)
    left = device_memory() - mx.get_active_memory() - prefix
    return max(GiB // 4, int(left * KV_HEADROOM))


class IdleRelease:
    """When to empty MLX's buffer cache: once per idle spell, after IDLE_RELEASE_S of it."""

    def __init__(self, after_s: float = IDLE_RELEASE_S) -> None:
        self.after_s = after_s
        self.idle_since: float | None = None
        self.released = True  # nothing ran since the last release (or since start)

    def due(self, busy: bool, now: float) -> bool:
        """Called each turn of the engine loop; True when the cache should go now."""
        if busy:
            self.idle_since, self.released = None, False
            return False
        if self.released:
            return False
        if self.idle_since is None:
            self.idle_since = now
        if now - self.idle_since < self.after_s:
            return False
        self.released = True
        return True


def heartbeat(
    worker_id: str,
    where: tuple[WorkerState, str, float],
    engine: Any,
    limits: MemoryLimits,
    process: psutil.Process,
    segments: PromptSegmentStats | None = None,
) -> Heartbeat:
    """A worker's heartbeat: its state, stage and progress (`where`), its engine's counts and
    prefix cache, its memory as the process and MLX see it, with the limits it set, and its
    prompt-segment memo (`segments`: None where it has none)."""
    state, stage, progress = where
    running, waiting = engine.counts() if engine else (0, 0)
    return Heartbeat(
        worker_id,
        state,
        engine.steps if engine else 0,
        running,
        waiting,
        process.memory_info().rss,
        mx.get_active_memory(),
        mx.get_cache_memory(),
        mx.get_peak_memory(),
        stage,
        progress,
        engine.prefix_stats() if engine else None,
        limits.wired_bytes,
        limits.cache_bytes,
        segments,
    )
