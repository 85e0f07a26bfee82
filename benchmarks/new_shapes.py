"""What a decode step costs at a row count met for the first time, in one process.

    python -m benchmarks.new_shapes MODEL --rows 32,33,47,64,100,128

For each row count, in this order, a batch of that many rows of different lengths (so that
the step takes the attention mask a served batch takes) decodes STEPS steps, greedy, on
mlx-lm's forward pass and on the project's compiled step
(worker/backends/decode_step.py), which of the two meets the count first alternating from
one count to the next (the second finds what they share built: matrix plans); each step is
timed to its token. Prints one JSON line per count and driver: whether the driver met the
count first (`first`), the first step (`first_ms`, which builds what the shape needs:
traces, kernels, matrix-multiplication plans) and the median of the steps after the second
(`later_ms`). On MLX's CUDA backend the difference is what the rows batch's row buckets
save a served batch at each row count it would otherwise meet (worker/backends/buckets.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.engine_steps import positive_ints

STEPS = 12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.new_shapes", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--rows", type=positive_ints, default=[32, 33, 47, 64, 100, 128])
    p.add_argument("--prompt", type=int, default=64, help="the longest row's prompt tokens")
    args = p.parse_args(argv)
    if args.prompt < 9:
        p.error("--prompt must be at least 9 (rows differ by up to 8 tokens)")
    return args


def _caches(model: Any, rows: int, prompt: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    layers = len(model.layers)
    each = []
    for i in range(rows):
        caches = [KVCache() for _ in range(layers)]
        model(mx.arange(1, prompt - i % 8 + 1).reshape(1, -1), cache=caches)
        each.append(caches)
    merged = [BatchKVCache.merge([row[layer] for row in each]) for layer in range(layers)]
    mx.eval([c.state for c in merged])
    return merged


def timed(step: Callable[[Any, list[Any]], Any], caches: list[Any], rows: int) -> dict[str, float]:
    import mlx.core as mx

    tokens = mx.array([3] * rows)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        tokens = mx.argmax(step(tokens, caches), axis=-1)
        mx.eval(tokens)
        times.append(1000 * (time.perf_counter() - start))
    return {"first_ms": round(times[0], 2), "later_ms": round(statistics.median(times[2:]), 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.backends.decode_step import build
    from worker.backends.mlx_lm import load

    model, _ = load(args.model)
    drivers: dict[str, Callable[[Any, list[Any]], Any]] = {
        "forward": lambda tokens, caches: model(tokens[:, None], cache=caches)[:, -1, :]
    }
    step = build(model)
    if step is not None:
        drivers["compiled"] = lambda tokens, caches: step(tokens, caches, masked=True)
    for at, rows in enumerate(args.rows):
        order = list(drivers.items())[:: -1 if at % 2 else 1]
        for name, run in order:
            line: dict[str, Any] = {"driver": name, "rows": rows, "first": name == order[0][0]}
            line.update(timed(run, _caches(model, rows, args.prompt), rows))
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
