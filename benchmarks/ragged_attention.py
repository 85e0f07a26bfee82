"""The ragged-attention kernel against MLX's attention, alone, on MLX's CUDA backend.

    python -m benchmarks.ragged_attention [--rows 32,128] [--length 256] [--layers 32]

For each head layout (the 1B shape's 32 query heads over 8 KV heads of 64, the 8B shape's
of 128) and row count, rows of 16 different lengths up to `--length` attend with one query
position each: `--layers` attention calls chained as a decode step's layers are (each
layer's output is the next one's query), evaluated together, timed over 30 runs (median,
host and device together), for
- `kernel`: worker/backends/ragged_attention.py (no mask);
- `masked`: MLX's `scaled_dot_product_attention` with the boolean mask the kernel replaces;
- `unmasked`: the same without a mask over the whole length (MLX's fused one-token kernel:
  what rows of one length cost; not the same function when rows are padded).
Also prints the largest difference between the kernel's and the masked attention's outputs.
One JSON line per (layout, rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

LAYOUTS = {"1b": (32, 8, 64), "8b": (32, 8, 128)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ragged_attention", description=__doc__)
    p.add_argument("--rows", default="32,128")
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--runs", type=int, default=30)
    return p.parse_args(argv)


def _timed(run: Callable[[], Any], runs: int) -> float:
    import mlx.core as mx

    mx.eval(run())  # compiles on first use
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(attend: Any, layout: tuple[int, int, int], rows: int, args: Any) -> dict[str, Any]:
    """One layout and row count: each attention's chained time and the kernel's difference."""
    import mlx.core as mx

    from worker.backends.ragged_attention import reference

    heads, kv_heads, dim = layout
    scale = dim**-0.5
    buffer = (rows, kv_heads, args.length + 256, dim)  # the cache's spare room
    k = mx.random.normal(buffer).astype(mx.bfloat16)[..., : args.length, :]
    v = mx.random.normal(buffer).astype(mx.bfloat16)[..., : args.length, :]
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    starts = mx.array([i % 16 for i in range(rows)], dtype=mx.int32)
    mask = (mx.arange(args.length)[None, :] >= starts[:, None])[:, None, None, :]
    mx.eval(k, v, q, mask)
    sdpa = mx.fast.scaled_dot_product_attention
    ways: dict[str, Callable[[mx.array], mx.array]] = {
        "kernel": lambda x: attend(x, k, v, starts),
        "masked": lambda x: sdpa(x, k, v, scale=scale, mask=mask),
        "unmasked": lambda x: sdpa(x, k, v, scale=scale),
    }
    line: dict[str, Any] = {"rows": rows, "length": args.length}
    for name, one in ways.items():

        def run(one: Callable[[mx.array], mx.array] = one) -> mx.array:
            x = q
            for _ in range(args.layers):
                x = one(x)
            return x

        line[f"{name}_ms"] = _timed(run, args.runs)
    got = attend(q, k, v, starts).astype(mx.float32)
    want = reference(q, k, v, starts, scale).astype(mx.float32)
    line["max_abs_diff"] = mx.abs(got - want).max().item()
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.backends.ragged_attention import make

    for name, layout in LAYOUTS.items():
        heads, kv_heads, dim = layout
        attend = make(heads, kv_heads, dim, dim**-0.5)
        if attend is None:
            print(json.dumps({"layout": name, "error": "no kernel on this backend"}))
            continue
        for rows in [int(r) for r in args.rows.split(",")]:
            line = {"layout": name, **measure(attend, layout, rows, args)}
            rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in line.items()}
            print(json.dumps(rounded), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
