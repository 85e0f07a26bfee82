"""What a cached turn's prefill is made of, in one process: mlx-lm's forward pass over a few
hundred new tokens on a long cached prefix, and MLX's attention alone at that shape.

    python -m benchmarks.cached_prefill MODEL [--cached 4400] [--new 16,128,250]

An agent's next turn prefills its new tokens (a tool result, a user message) over every
cached position before them. The model's plain KV cache is filled with `--cached` positions
once; each trial runs the forward pass over NEW tokens on it up to its keys and values (as
the engine's prefill does: no logits) and trims the cache back. First `cold_ms`: ten
lengths after the last NEW, each met once, as a served worker meets a conversation's turns
without prefill buckets. Then for each length and way: `first_ms` (that way's first call at
that length: only the first way meets the length's shapes for the first time) and `warm_ms`
(the median of `--trials` after two more); and `attention_ms`: MLX's
`scaled_dot_product_attention` at that shape (the model's heads), once a layer in one
evaluation, each call on the last one's output, the median over `--trials`, with each mask
a cache hands it: `causal` (mlx-lm's plain cache: no array), `array` (its batch cache: a
boolean array over the keys) and `bucket` (the prefill buckets: a boolean array over a
bucket of keys, the positions past the written ones hidden). Under CUDA cuDNN's attention
takes a mask array as a bias, and off cuDNN MLX's own composes the attention of several
queries from separate operations either way.

The ways: `plain`, the model's own cache; and with `--via`, the ways the rows batch
(worker/backends/rows.py) runs the same prefill, each trial on a batch cache made anew from
the cached positions (as a prefix cache hit is), that copy included: `batch`, mlx-lm's batch
cache (its mask array); `buckets`, the same through the views of
worker/backends/prefill_buckets.py (new tokens padded to a bucket, attention over a bucket
of keys with a mask array); `kernel`, the same with the project's layers and attention
kernel, the engine's way under CUDA (its layers on the compiled decode step's functions),
and `kernel-modules`, its layers through the model's modules instead (both only where the
kernel is made: MLX's CUDA backend). A NEW is at most one prefill chunk
(`engine.prefill_step_size`'s default), as a cached turn's new tokens mostly are.

MLX runs as a worker runs it (under CUDA, off cuDNN's attention; on a CPU, OpenBLAS
preloaded: it re-executes itself under a worker's environment, benchmarks/_launch.py
`as_worker`) unless the environment says otherwise (`MLX_CUDA_USE_CUDNN_SDPA=1` for
cuDNN's).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks import _launch
from benchmarks.engine_steps import positive_ints
from shared.blas import CUDNN_SDPA, mlx_worker_defaults
from shared.engine_options import EngineOptions

COLD = 10  # lengths met once each
WAYS = ("batch", "buckets", "kernel", "kernel-modules")
CHUNK = EngineOptions().prefill_step_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cached_prefill", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--cached", type=int, default=4400, help="cached positions before the turn")
    p.add_argument("--new", type=positive_ints, default=[16, 128, 250], help="new tokens")
    p.add_argument("--trials", type=int, default=10, help="timed trials a shape, after 3")
    p.add_argument(
        "--via",
        default=",".join(WAYS),
        help=f"more ways: {', '.join(WAYS)} ('': none)",
    )
    args = p.parse_args(argv)
    if args.cached < 1 or args.trials < 1:
        p.error("--cached and --trials must be at least 1")
    if max(args.new) + COLD > CHUNK:
        p.error(f"--new: at most {CHUNK - COLD} tokens (one prefill chunk, the cold lengths after)")
    args.via = [w for w in args.via.split(",") if w]
    if set(args.via) - set(WAYS):
        p.error(f"--via: ways are {', '.join(WAYS)}")
    return args


def _ms(run: Callable[[], None]) -> float:
    import mlx.core as mx

    mx.synchronize()
    started = time.perf_counter()
    run()
    mx.synchronize()
    return 1000 * (time.perf_counter() - started)


def _tokens(n: int, width: int) -> Any:
    import mlx.core as mx

    return mx.array([[(11 * i) % 300 + 5 for i in range(n)] + [0] * (width - n)])


def plain(model: Any, cache: list[Any], n: int) -> float:
    """The forward pass over n new tokens on the model's own cache, which it leaves as found."""
    import mlx.core as mx

    tokens = _tokens(n, n)

    def run() -> None:
        model(tokens, cache=cache)
        mx.eval([c.state for c in cache])

    ms = _ms(run)
    for c in cache:
        c.trim(n)
    return ms


def batched(model: Any, cache: list[Any], n: int, way: str, layers: Any = None) -> float:
    """The same on a batch cache copied from `cache` (untouched), through the prefill
    buckets' views for `way` "buckets", and for "kernel" and "kernel-modules" with
    `layers`, the project's layers and its attention kernel (worker/backends/
    prefill_layers.py: on the compiled decode step's functions, as a worker's prefill runs
    on MLX's CUDA backend, or through the model's modules)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from worker.backends.groups import FirstToken
    from worker.backends.prefill_buckets import padded_width, views

    tokens = _tokens(n, padded_width(n, CHUNK) if way != "batch" else n)
    mx.eval(tokens)
    first = FirstToken(model, layers)

    def run() -> None:
        batch = [BatchKVCache.merge([c]) for c in cache]
        seen = views(batch) if way != "batch" else batch
        if seen is None:  # not a state the buckets read: no forward pass without a cache
            raise RuntimeError("--via buckets: this mlx-lm's batch cache is not bucketed")
        first.forward(model, tokens, seen)  # the model's own forward pass without `layers`
        mx.eval([c.state for c in batch])

    return _ms(run)


MASKS = ("causal", "array", "bucket")  # attention_ms's masks (module docstring)
KERNEL = "kernel"  # attention_ms's entry for the project's kernel over a bucket of keys


def keys_and_mask(mask: str, cached: int, n: int) -> tuple[int, Any]:
    """The keys attention runs over and the mask it is handed for n queries after `cached`
    positions, as the cache `mask` names hands them (MASKS)."""
    import mlx.core as mx

    from worker.backends.prefill_buckets import KEY_BUCKET, bucket

    if mask == "causal":
        return cached + n, "causal"
    width = cached + n if mask == "array" else bucket(cached + n, KEY_BUCKET)
    return width, (mx.arange(cached, cached + n)[:, None] >= mx.arange(width)[None])[None, None]


def attention(
    shape: tuple[int, int, int, Any],
    cached: int,
    n: int,
    layers: int,
    mask: str,
    kernel: Any = None,
) -> float:
    """MLX's attention of n queries over cached + n keys, once a layer, in one evaluation;
    the mask as a cache hands it (keys_and_mask); with `kernel`, that kernel's (mask
    KERNEL: over a bucket of keys, the causal limit and the row's start as integers)."""
    import mlx.core as mx

    heads, kv_heads, head_dim, dtype = shape
    width, given = keys_and_mask("bucket" if mask == KERNEL else mask, cached, n)
    q = mx.random.normal((1, heads, n, head_dim)).astype(dtype)
    k, v = (mx.random.normal((1, kv_heads, width, head_dim)).astype(dtype) for _ in "kv")
    base, starts = mx.array([cached], dtype=mx.int32), mx.array([0], dtype=mx.int32)
    mx.eval(q, k, v, given if mask != "causal" else q, base, starts)

    def run() -> None:
        out = q
        for _ in range(layers):
            if mask == KERNEL:  # its output is (rows, n, heads, D): the next layer's queries
                out = kernel(out, k, v, base, starts).transpose(0, 2, 1, 3)
            else:
                scale = head_dim**-0.5
                out = mx.fast.scaled_dot_product_attention(out, k, v, scale=scale, mask=given)
        mx.eval(out)

    return _ms(run)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _launch.as_worker("benchmarks.cached_prefill", argv)
    mlx_env = mlx_worker_defaults(os.environ)  # before MLX: as a worker runs it
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from worker.backends import decode_step, groups

    model, _ = load(args.model)
    cache = make_prompt_cache(model)
    if any(type(c) is not KVCache for c in cache):
        raise SystemExit("cached_prefill: the model's cache is not mlx-lm's plain KVCache")
    prefix = mx.array([[(7 * i) % 300 + 5 for i in range(args.cached)]])
    for start in range(0, args.cached, 1024):
        model(prefix[:, start : start + 1024], cache=cache)
        mx.eval([c.state for c in cache])
    line: dict[str, Any] = {"cached": args.cached, "layers": len(model.layers)}
    last = args.new[-1]
    line["cold_ms"] = [round(plain(model, cache, n), 2) for n in range(last + 1, last + 1 + COLD)]

    config = model.args
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = cache[0].state[0].dtype  # the keys' as attention reads them
    shape = (heads, config.num_key_value_heads, head_dim, dtype)
    # the kernel's layers (None off MLX's CUDA backend): on the compiled decode step's
    # functions, as a worker runs them, and through the model's modules
    kernels: dict[str, Any] = {}
    if "kernel" in args.via:
        step = decode_step.build(model, asked=False)
        kernels["kernel"] = groups.prefill_kernel(model, asked=True, step=step)
    if "kernel-modules" in args.via:
        kernels["kernel-modules"] = groups.prefill_kernel(model, asked=True)
    kernel = next((k for k in kernels.values() if k is not None), None)
    ways: dict[str, Callable[[int], float]] = {"plain": functools.partial(plain, model, cache)}
    for way in args.via:
        if way not in kernels or kernels[way] is not None:
            layers = kernels.get(way)
            ways[way] = functools.partial(batched, model, cache, way=way, layers=layers)
    masks = [*MASKS, KERNEL] if kernel is not None else list(MASKS)
    line["forward"], line["attention_ms"] = {way: {} for way in ways}, {}
    for n in args.new:
        for way, run in ways.items():
            first = run(n)
            times = [run(n) for _ in range(args.trials + 2)][2:]
            line["forward"][way][n] = {"first_ms": round(first, 2), "warm_ms": _median(times)}
        for mask in masks:
            attend = kernel.attend if kernel is not None else None
            times = [
                attention(shape, args.cached, n, len(model.layers), mask, attend)
                for _ in range(args.trials)
            ]
            line["attention_ms"].setdefault(mask, {})[n] = _median(times)
    line["cudnn_sdpa"] = mlx_env[CUDNN_SDPA]
    print(json.dumps(line), flush=True)
    return 0


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


if __name__ == "__main__":
    raise SystemExit(main())
