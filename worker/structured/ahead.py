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


def guide_logits(
    rows: list[Any],
    fresh: set[int],
    version: int,
    masks: Masks,
    logits: mx.array,
    inputs: mx.array,
    ahead: Ahead | None,
) -> tuple[mx.array, list[int] | None]:
    """Masks the guided rows' logits in a step of the rows batch (its `rows` in order, the
    `fresh` ones whose input is their prompt's last token, its `version` of them): with the
    masks the guide thread computed for this step (it took each row's previous token), and
    those of rows it did not see (joined this step). Returns the step's input tokens too when
    the thread read them for the batch's rows as they are (None: the caller reads them)."""
    masked: Masked | None = None
    if ahead is not None:
        if not ahead.future.done():
            # the device runs the forward pass while the thread finishes
            mx.async_eval(logits)
        masked = ahead.future.result()
    same = masked is not None and ahead is not None and ahead.version == version
    tokens = masked.tokens if same and masked is not None else None
    at: list[int] = []  # rows masked, and their bitmask lines
    lines: list[np.ndarray] = []
    if masked is not None:
        if same:
            for j, i in enumerate(masked.at):
                if not rows[i].dead:
                    at.append(i)
                    lines.append(masked.bitmask[j])
        else:
            assert ahead is not None
            index = {r.uid: i for i, r in enumerate(rows) if not r.dead}
            for j, i in enumerate(masked.at):
                now = index.get(ahead.rows[i].uid)
                if now is not None:
                    at.append(now)
                    lines.append(masked.bitmask[j])
    packed = None  # the thread's device array, while it still says it all
    if same and masked is not None and len(at) == len(masked.at):
        packed = masked.packed
    late: list[Any] = []  # rows the thread did not see: joined this step
    if not same:
        seen = {r.uid for r in ahead.rows} if ahead is not None else set()
        late = [r for r in rows if r.guide and r.uid not in seen and not r.dead]
    if late:
        if tokens is None and any(r.uid not in fresh for r in late):
            mx.async_eval(logits)
            tokens = inputs.tolist()  # type: ignore[assignment]
        position = {r.uid: i for i, r in enumerate(rows)}
        for r in late:
            if r.uid not in fresh:  # a token to take (not expected: joined rows are)
                assert r.guide is not None and tokens is not None
                r.guide.consume(tokens[position[r.uid]])
        bitmask, filled = masks.fill([r.guide for r in late])
        for r, line, forbids in zip(late, bitmask, filled, strict=True):
            if forbids:
                at.append(position[r.uid])
                lines.append(line)
                packed = None
    for row in rows:
        if row.guide is not None:
            row.guide.settle()
    if not at:
        return logits, tokens
    if packed is None:
        every = len(at) == len(rows)
        if every:
            order = sorted(range(len(at)), key=at.__getitem__)
            lines = [lines[k] for k in order]
        packed = pack(np.stack(lines), None if every else at)
    return masks.apply_packed(logits, packed), tokens
