"""What a prefill costs at a shape met for the first time, in one process.

    python -m benchmarks.prefill_shapes MODEL [--rows 1,3,8,28] [--lengths 96,110,127]
                                              [--prefix 16] [--long 8192]

A served worker's joins prefill groups of rows whose count and prompt lengths change from one
join to the next (the rows batch, worker/backends/rows.py: each row's prefix from the prefix
cache, merged, the group right-padded to its longest prompt). For each row count and length,
in this order, such a group is prefilled three times (`--again`: the prefills after the
first), each to its last logits; the first meets the shape for the first time. On MLX's
CUDA backend a new shape of attention over several query positions builds a cuDNN graph
(`MLX_CUDA_USE_CUDNN_SDPA`, on by default; off, MLX computes the attention with separate
operations), so the script is meant to run once with each setting. Then one row of
`--long` prompt tokens is prefilled in chunks of `--chunk`, twice (every chunk attends over
a longer cache: a new shape each), what long prompts cost either way.

Prints one JSON line per shape (`first_ms`, `later_ms`: the median of those after) and
one for the long prompt (`first_ms`, `again_ms`), then a summary line: the medians over the
shapes, and `MLX_CUDA_USE_CUDNN_SDPA` as the process saw it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks.engine_steps import positive_ints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_shapes", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--rows", type=positive_ints, default=[1, 3, 8, 28])
    p.add_argument("--lengths", type=positive_ints, default=[96, 110, 127])
    p.add_argument("--prefix", type=int, default=16, help="each row's cached prefix (tokens)")
    p.add_argument("--long", type=int, default=8192, help="the long prompt (0: none)")
    p.add_argument("--chunk", type=int, default=2048, help="its prefill chunk (tokens)")
    p.add_argument(
        "--again", type=int, default=2, help="prefills of each shape after its first (0: none)"
    )
    args = p.parse_args(argv)
    if min(args.prefix, args.long, args.again) < 0 or args.chunk < 1:
        p.error("--prefix, --long and --again must be at least 0, --chunk at least 1")
    return args


def _group(model: Any, rows: int, length: int, prefix: int) -> tuple[list[Any], Any, bool]:
    """A group's caches (each row's prefix, merged; right-padded when lengths differ) and its
    tokens: the rows' prompts after their prefix, one to four tokens shorter row by row."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    layers = len(model.layers)
    each = []
    for _ in range(rows):
        caches = [KVCache() for _ in range(layers)]
        if prefix:
            model(mx.arange(1, prefix + 1).reshape(1, -1), cache=caches)
        each.append(caches)
    merged = [BatchKVCache.merge([row[layer] for row in each]) for layer in range(layers)]
    lengths = [max(1, length - i % 4) for i in range(rows)]
    padding = [length - n for n in lengths]
    padded = max(padding) > 0
    if padded:
        for c in merged:
            c.prepare(lengths=lengths, right_padding=padding)
    tokens = mx.array(
        [
            [5 + (i + j) % 97 for j in range(n)] + [0] * p
            for i, (n, p) in enumerate(zip(lengths, padding, strict=True))
        ]
    )
    mx.eval([c.state for c in merged], tokens)
    return merged, tokens, padded


def prefill_ms(model: Any, rows: int, length: int, prefix: int) -> float:
    import mlx.core as mx

    caches, tokens, padded = _group(model, rows, length, prefix)
    start = time.perf_counter()
    logits = model(tokens, cache=caches)[:, -1, :]
    if padded:
        for c in caches:
            c.finalize()
    mx.eval(logits, [c.state for c in caches])
    return 1000 * (time.perf_counter() - start)


def long_ms(model: Any, tokens: int, chunk: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    prompt = mx.array([[5 + j % 97 for j in range(tokens)]])
    mx.eval(prompt)
    start = time.perf_counter()
    for at in range(0, tokens, chunk):
        logits = model(prompt[:, at : at + chunk], cache=caches)[:, -1, :]
        mx.eval(logits, [c.state for c in caches])
    return 1000 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.backends.mlx_lm import load

    model, _ = load(args.model)
    prefill_ms(model, 2, 8, args.prefix)  # the first call's own costs, out of the figures
    firsts, laters = [], []
    for rows in args.rows:
        for length in args.lengths:
            times = [prefill_ms(model, rows, length, args.prefix) for _ in range(1 + args.again)]
            firsts.append(times[0])
            line: dict[str, Any] = {"rows": rows, "length": length, "first_ms": round(times[0], 2)}
            if args.again:
                laters.append(statistics.median(times[1:]))
                line["later_ms"] = round(laters[-1], 2)
            print(json.dumps(line), flush=True)
    summary: dict[str, Any] = {
        "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1 (default)"),
        "shapes": len(firsts),
        "first_ms_median": round(statistics.median(firsts), 2),
    }
    if laters:
        summary["later_ms_median"] = round(statistics.median(laters), 2)
    if args.long:
        first, again = (long_ms(model, args.long, args.chunk) for _ in range(2))
        line = {"long": args.long, "chunk": args.chunk, "first_ms": round(first, 1)}
        print(json.dumps({**line, "again_ms": round(again, 1)}), flush=True)
        summary.update(long_first_ms=round(first, 1), long_again_ms=round(again, 1))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
