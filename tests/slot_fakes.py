"""A model's slot with a worker that exists only as its frames: a Ready and a heartbeat, no
process (unit tests of what the gateway shows about its workers)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import cast

from gateway.workers.slots import Slot, WorkerHandle
from shared.config import ModelConfig
from shared.protocol import (
    Capacity,
    Heartbeat,
    PrefixCacheStats,
    PromptSegmentStats,
    Ready,
    WorkerState,
)

GiB = 2**30


def heartbeat(
    prefix_cache: PrefixCacheStats | None = None,
    prompt_segments: PromptSegmentStats | None = None,
) -> Heartbeat:
    return Heartbeat(
        "w1",
        WorkerState.READY,
        step=7,
        running=1,
        waiting=0,
        prefix_cache=prefix_cache,
        prompt_segments=prompt_segments,
    )


def ready_slot(name: str, hb: Heartbeat | None = None) -> Slot:
    """A ready model whose worker last sent `hb` (its pid is this process's: it exists)."""
    config = ModelConfig(name=name, source="/nowhere")
    process = cast(asyncio.subprocess.Process, SimpleNamespace(pid=os.getpid()))
    handle = WorkerHandle(config, "w1", process, heartbeat=hb)
    handle.info = Ready("w1", Capacity(8, 32, 4096), prefix_cache_bytes=2 * GiB)
    return Slot(config, handle=handle)


STATS = PrefixCacheStats(
    entries=12,
    nbytes=int(1.2 * GiB),
    capacity_bytes=2 * GiB,
    lookups=40,
    hits=25,
    hit_tokens=9000,
    evictions=3,
    oversize=2,
)
SEGMENTS = PromptSegmentStats(
    entries=30,
    nbytes=3_250_000,
    capacity_bytes=32 * 2**20,
    prompts=9,
    hits=46,
    misses=4,
    evictions=2,
)
