"""What a cached turn's prefill is made of, in one process: mlx-lm's forward pass over a few
hundred new tokens on a long cached prefix, and MLX's attention alone at that shape.

    python -m benchmarks.cached_prefill MODEL [--cached 4400] [--new 16,128,250]

An agent's next turn prefills its new tokens (a tool result, a user message) over every
cached position before them. The model's plain KV cache is filled with `--cached` positions
once; each trial runs the forward pass over NEW tokens on it, to the last position's logits,
and trims the cache back. For each length: `first_ms` (the shape met for the first time) and
`warm_ms` (the median of `--trials` after two more); `cold_ms`: lengths from the last NEW
up, each met once, as a served worker meets a conversation's turns without prefill
buckets; `attention_ms`: MLX's `scaled_dot_product_attention` alone at each shape (the
model's heads, causal), the median over `--trials`, times the layers.

`--via` adds the ways the rows batch (worker/backends/rows.py) runs the same prefill, each
trial on a batch cache made anew from the cached positions (as a prefix cache hit is), that
copy included: `batch`, mlx-lm's batch cache (its mask array); `buckets`, the same through
the views of worker/backends/prefill_buckets.py (new tokens padded to a bucket, attention
over a bucket of keys with a mask array), the engine's way under CUDA. `forward` then has
one entry a way (`plain` the model's own cache).

MLX runs as a worker runs it (`shared.blas.mlx_worker_defaults`: under CUDA, off cuDNN's
attention) unless the environment says otherwise (`MLX_CUDA_USE_CUDNN_SDPA=1` for cuDNN's).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks.engine_steps import positive_ints
from shared.blas import CUDNN_SDPA, mlx_worker_defaults

COLD = 10  # lengths met once each
WAYS = ("batch", "buckets")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cached_prefill", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--cached", type=int, default=4400, help="cached positions before the turn")
    p.add_argument("--new", type=positive_ints, default=[16, 128, 250], help="new tokens")
    p.add_argument("--trials", type=int, default=10, help="timed trials a shape, after 3")
    p.add_argument("--via", default="batch,buckets", help="more ways: batch, buckets ('': none)")
    args = p.parse_args(argv)
    if args.cached < 1 or args.trials < 1:
        p.error("--cached and --trials must be at least 1")
    args.via = [w for w in args.via.split(",") if w]
    if set(args.via) - set(WAYS):
        p.error(f"--via: ways are {', '.join(WAYS)}")
    return args


def _ms(run: Any) -> float:
    import mlx.core as mx

    mx.synchronize()
    started = time.perf_counter()
    run()
    mx.synchronize()
    return 1000 * (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mlx_env = mlx_worker_defaults(os.environ)  # before MLX: as a worker runs it
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(args.model)
    cache = make_prompt_cache(model)
    prefix = mx.array([[(7 * i) % 300 + 5 for i in range(args.cached)]])
    for start in range(0, args.cached, 1024):
        model(prefix[:, start : start + 1024], cache=cache)
        mx.eval([c.state for c in cache])

    def forward(n: int) -> float:
        tokens = mx.array([[(11 * i) % 300 + 5 for i in range(n)]])
        ms = _ms(lambda: mx.eval(model(tokens, cache=cache)[:, -1, :]))
        for c in cache:
            c.trim(n)
        return ms

    def batched(way: str, n: int) -> float:
        from mlx_lm.models.cache import BatchKVCache

        from worker.backends.prefill_buckets import TOKEN_BUCKET, bucket, views

        width = bucket(n, TOKEN_BUCKET) if way == "buckets" else n
        tokens = mx.array([[(11 * i) % 300 + 5 for i in range(n)] + [0] * (width - n)])
        mx.eval(tokens)

        def run() -> None:
            batch = [BatchKVCache.merge([c]) for c in cache]
            seen = views(batch) if way == "buckets" else batch
            if seen is None:  # not a state the buckets read: no forward pass without a cache
                raise RuntimeError("--via buckets: this mlx-lm's batch cache is not bucketed")
            mx.eval(model(tokens, cache=seen)[:, n - 1, :])

        return _ms(run)

    config, layers = model.args, len(model.layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = cache[0].state[0].dtype  # the keys' as attention reads them
    ways = {"plain": forward} | {w: (lambda n, w=w: batched(w, n)) for w in args.via}
    line: dict[str, Any] = {"cached": args.cached, "layers": layers, "forward": {}}
    line["attention_ms"] = {}
    for n in args.new:
        for way, run in ways.items():
            first = run(n)
            times = [run(n) for _ in range(args.trials + 2)][2:]
            entry = {"first_ms": round(first, 2), "warm_ms": _median(times)}
            line["forward"].setdefault(way, {})[n] = entry
        q = mx.random.normal((1, heads, n, head_dim)).astype(dtype)
        k, v = (
            mx.random.normal((1, kv_heads, args.cached + n, head_dim)).astype(dtype)
            for _ in range(2)
        )
        mx.eval(q, k, v)

        def attend(q: Any = q, k: Any = k, v: Any = v) -> None:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal")
            mx.eval(out)

        attend()
        one = _median([_ms(attend) for _ in range(args.trials + 2)][2:])
        line["attention_ms"][n] = round(one * layers, 2)
    last = args.new[-1]
    line["cold_ms"] = [round(forward(n), 2) for n in range(last + 1, last + 1 + COLD)]
    line["cudnn_sdpa"] = mlx_env[CUDNN_SDPA]
    print(json.dumps(line), flush=True)
    return 0


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


if __name__ == "__main__":
    raise SystemExit(main())
