"""A guided batch's masks, a step ahead, on a thread of their own (the rows batch's: see
worker/backends/rows.py): a row is anything with `uid`, `guide` and `dead`."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from worker.structured.guide import Masks, Packed, pack


@dataclass(slots=True, eq=False)
class Masked:
    """What the guide thread made of a step's input tokens: each guided row took its token,
    then the masks of the rows whose guide forbids something."""

    tokens: list[int]  # each submitted row's input token
    at: list[int]  # the masked rows (indices into the submitted rows)
    bitmask: np.ndarray  # their bitmask lines, in that order
    packed: Packed | None  # the same on the device (None: nothing masked)


@dataclass(slots=True, eq=False)
class Ahead:
    future: Future[Masked]
    rows: list[Any]  # the batch's rows when submitted, in the order of its inputs
    version: int  # RowBatch.version then


class GuideThread:
    """Computes a guided batch's masks a step ahead, on one thread: submitted when a step's
    tokens are queued, it waits for them, hands each guided row its token and fills the
    masks of the step after, while the main thread returns the step's output and builds the
    next forward pass. On a GPU whose decode steps are bound by the host, a mask over a 128k
    vocabulary and making its device array otherwise add to every step of the whole batch
    (docs/benchmarks.md). The thread runs while the main one has released the GIL (MLX
    does, while it encodes a step)."""

    def __init__(self, masks: Masks) -> None:
        self.masks = masks
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, probe: mx.array, rows: list[Any], version: int) -> Ahead:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="guides")
        return Ahead(self._pool.submit(self._work, probe, rows), rows, version)

    def _work(self, probe: mx.array, rows: list[Any]) -> Masked:
        tokens: list[int] = probe.tolist()  # type: ignore[assignment]
        guided: list[int] = []
        for i, row in enumerate(rows):
            if row.guide is not None and not row.dead:
                row.guide.consume(tokens[i])
                guided.append(i)
        if not guided:
            return Masked(tokens, [], np.empty((0, 0), np.int32), None)
        bitmask, filled = self.masks.fill([rows[i].guide for i in guided])
        at = [i for i, forbids in zip(guided, filled, strict=True) if forbids]
        if len(at) < len(guided):
            bitmask = bitmask[[j for j, forbids in enumerate(filled) if forbids]]
        if not at:
            return Masked(tokens, [], bitmask, None)
        return Masked(tokens, at, bitmask, pack(bitmask, None if len(at) == len(rows) else at))
