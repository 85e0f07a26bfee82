"""What taking rows' KV out of a batch costs (for the prefix cache), in one process.

    python -m benchmarks.leaving MODEL --rows 8,32,128 --length 256

For each row count, a batch cache of the model's layers (its KV shapes and dtype, random
values) holding that many rows of about `--length` positions; the rows are taken out
`--repeats` times each way, rotating which goes first:
- `per_row`: mlx-lm's `BatchKVCache.extract`, row by row and layer by layer (a copy of the
  keys and one of the values each), then one `async_eval` of them all, as the rows batch did;
- `gather` and `concat`: worker/backends/shelves.py, rows of about the same length copied
  out together, per layer one buffer of their keys and one of their values, made by one
  gather kernel (`take`, the rows batch's way on a GPU) or by a concatenation of the rows'
  slices (its way on the CPU), then one `async_eval`.
Prints one JSON line per count and way: the median host time until the copies are queued
(`host_ms`) and until they are done (`total_ms`). The served step trace
(benchmarks/step_trace.py) shows the same cost as host time outside the backend's step in
the steps where rows finish.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.engine_steps import positive_ints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.leaving", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--rows", type=positive_ints, default=[8, 32, 128])
    p.add_argument("--length", type=int, default=256, help="the longest row's positions")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if args.length < 9:
        p.error("--length must be at least 9 (rows differ by up to 8 positions)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def batch_caches(model: Any, rows: int, length: int) -> list[Any]:
    """One BatchKVCache per layer: `rows` rows of `length` - (0..7) positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    shapes = make_prompt_cache(model)
    model(mx.array([[1]]), cache=shapes)
    caches = []
    for layer in shapes:
        _, heads, _, dim = layer.keys.shape
        cache = BatchKVCache([i % 8 for i in range(rows)])
        values = mx.random.normal((rows, heads, length, dim)).astype(layer.keys.dtype)
        cache.update_and_fetch(values, values)
        caches.append(cache)
    mx.eval([c.state[:4] for c in caches])
    return caches


def per_row(caches: list[Any], rows: list[tuple[int, int]]) -> list[Any]:
    import mlx.core as mx

    kept = [[c.extract(i) for c in caches] for i, _ in rows]
    mx.async_eval([[c.keys, c.values] for row in kept for c in row])
    return kept


def shelves(caches: list[Any], rows: list[tuple[int, int]], gather: bool) -> list[Any]:
    import mlx.core as mx

    from worker.backends.shelves import shelve

    kept = shelve(caches, rows, 1 << 40, gather)
    assert kept is not None, "this mlx-lm's BatchKVCache state reads otherwise"
    mx.async_eval([[k.shelf.keys, k.shelf.values] for k in kept])
    return kept


WAYS: dict[str, Callable[[list[Any], list[tuple[int, int]]], list[Any]]] = {
    "per_row": per_row,
    "gather": lambda caches, rows: shelves(caches, rows, True),
    "concat": lambda caches, rows: shelves(caches, rows, False),
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import mlx.core as mx
    from mlx_lm import load

    model = load(args.model)[0]
    ways = WAYS
    for n, count in enumerate(args.rows):
        caches = batch_caches(model, count, args.length)
        rows = [(i, args.length - i % 8) for i in range(count)]
        times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        for repeat in range(args.repeats + 1):  # the first: warm-up
            order = list(ways)[(n + repeat) % len(ways) :] + list(ways)[: (n + repeat) % len(ways)]
            for way in order:
                mx.synchronize()
                start = time.perf_counter()
                kept = ways[way](caches, rows)
                queued = time.perf_counter()
                mx.synchronize()
                done = time.perf_counter()
                del kept
                if repeat:
                    times[way].append(((queued - start) * 1e3, (done - start) * 1e3))
        for way, pairs in times.items():
            line = {
                "rows": count,
                "way": way,
                "host_ms": round(statistics.median(p[0] for p in pairs), 3),
                "total_ms": round(statistics.median(p[1] for p in pairs), 3),
                "layers": len(caches),
                "device": str(mx.default_device()),
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
