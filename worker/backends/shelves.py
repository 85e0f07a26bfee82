"""Rows' KV taken out of the rows batch (for the prefix cache) in one copy per layer, not one
per row.

Each copy is a kernel the host builds and launches. Copying every leaving row's keys and
values out on its own costs 2 x layers x rows of them: on an H200 the step trace
(benchmarks/step_trace.py) put a cohort of 102 rows leaving a 1B-shaped model's batch at
265 ms of host time, 116 rows at 8B at about 200 ms, against a 5-25 ms decode step.
Here rows of about the same length go out together onto a *shelf*: per layer one buffer of
their keys and one of their values, whatever the number of rows.

A shelved row's KV is a view of its shelf, not a copy of its own, so a shelf's memory goes
only when its last row goes: the prefix cache counts the shelf, once, as long as any of its
rows is kept (`storage`), and copies a row out on its own (`copy`) only when the shelf goes
while that row is worth keeping (worker/engine/prefix_cache.py). A row joins a shelf only
when it is at least (1 - 1/SPREAD) as long as the shelf's longest (the rest of the shelf's
span is padding it carries) and while the shelf stays within `max_bytes` (a row larger than
that is on a shelf of its own).

It reads the batch caches through `BatchKVCache.state` (keys, values, offset, left padding,
the end of the positions written: mlx-lm 0.32). A cache whose state reads otherwise makes
`shelve` answer None, and the caller copies row by row through mlx-lm's own `extract`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

SPREAD = 8


@dataclass(slots=True, eq=False)
class Shelf:
    """Rows' keys and values, layer by layer: (rows, kv heads, span, head dim) each."""

    keys: list[mx.array]
    values: list[mx.array]
    nbytes: int


@dataclass(slots=True, eq=False)
class Shelved:
    """One row's KV on a shelf: its `length` positions from `start` of row `row`."""

    shelf: Shelf
    row: int
    start: int
    length: int
    nbytes: int  # its share: its own positions

    def caches(self, length: int | None = None) -> list[Any]:
        """A KVCache per layer over the first `length` positions (all by default), views
        of the shelf; mlx-lm copies them into a batch when a row starts from them."""
        n = self.length if length is None else length
        span = slice(self.start, self.start + n)
        return [
            _kv(keys[self.row : self.row + 1, :, span], values[self.row : self.row + 1, :, span])
            for keys, values in zip(self.shelf.keys, self.shelf.values, strict=True)
        ]

    def copy(self) -> list[Any]:
        """The row's KV in buffers of its own (queued, not waited for)."""
        caches = [_kv(mx.contiguous(c.keys), mx.contiguous(c.values)) for c in self.caches()]
        mx.async_eval([[c.keys, c.values] for c in caches])
        return caches


def _kv(keys: mx.array, values: mx.array) -> Any:
    """An mlx-lm KVCache holding `keys` and `values` (its public attributes, set as
    BatchKVCache.extract sets them)."""
    cache = KVCache()
    cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
    return cache


def shelve(
    caches: list[Any], rows: list[tuple[int, int]], max_bytes: int, gather: bool | None = None
) -> list[Shelved] | None:
    """The KV of `rows` (batch index, positions held) of a batch whose layers keep `caches`
    (BatchKVCache, right-aligned: every row's positions end where the batch's do), in the
    order given; None when a cache's state is not mlx-lm 0.32's.

    `gather`: a shelf's layer is one gather kernel (`take`) over the batch's rows (the
    default on a GPU: one launch, where a concatenation launches a copy per row; measured
    neither on CUDA nor on Metal yet, benchmarks/leaving.py will); False: a concatenation
    of the rows' slices (the default on the CPU, where MLX's gather of a strided slice took
    twice as long, benchmarks/leaving.py)."""
    if gather is None:
        gather = mx.default_device() == mx.gpu
    states = [c.state for c in caches]
    if not states or any(not isinstance(s, tuple) or len(s) != 5 for s in states):
        return None
    end = states[0][4]
    if not isinstance(end, int) or any(s[4] != end for s in states):
        return None
    per_position = sum(
        k.shape[1] * k.shape[3] * k.dtype.size + v.shape[1] * v.shape[3] * v.dtype.size
        for k, v, *_ in states
    )
    shelved: dict[int, Shelved] = {}
    for group in _groups(rows, per_position, max_bytes):
        longest = group[0][1]
        lo = end - longest
        indices = [i for i, _ in group]
        shelf = Shelf(
            [_rows(k[:, :, lo:end], indices, gather) for k, *_ in states],
            [_rows(v[:, :, lo:end], indices, gather) for _, v, *_ in states],
            len(group) * longest * per_position,
        )
        for j, (i, length) in enumerate(group):
            shelved[i] = Shelved(shelf, j, longest - length, length, length * per_position)
    return [shelved[i] for i, _ in rows]


def take_out(caches: list[Any], rows: list[tuple[int, int]], max_bytes: int) -> list[Any]:
    """`shelve`'s rows; row by row through mlx-lm's `BatchKVCache.extract` (a list of
    caches each) where the batch caches' state reads otherwise."""
    kept = shelve(caches, rows, max_bytes)
    if kept is not None:
        return list(kept)
    return [[c.extract(i) for c in caches] for i, _ in rows]


def _rows(array: mx.array, indices: list[int], gather: bool) -> mx.array:
    """The rows `indices` of `array`, in a buffer of their own."""
    if len(indices) == 1:
        return mx.contiguous(array[indices[0] : indices[0] + 1])
    if gather:
        return mx.take(array, mx.array(indices), axis=0)
    return mx.concatenate([array[i : i + 1] for i in indices], axis=0)


def _groups(
    rows: list[tuple[int, int]], per_position: int, max_bytes: int
) -> list[list[tuple[int, int]]]:
    """Rows by shelf, each shelf's longest row first."""
    groups: list[list[tuple[int, int]]] = []
    for i, length in sorted(rows, key=lambda r: -r[1]):
        if groups:
            group = groups[-1]
            longest = group[0][1]
            fits = (len(group) + 1) * longest * per_position <= max_bytes
            if fits and length * SPREAD >= longest * (SPREAD - 1):
                group.append((i, length))
                continue
        groups.append([(i, length)])
    return groups


def storage(cache: Any) -> tuple[Shelf, int] | None:
    """The shelf a cache is a view of and its bytes; None for a cache of its own."""
    return (cache.shelf, cache.shelf.nbytes) if isinstance(cache, Shelved) else None
