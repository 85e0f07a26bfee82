"""Decode step, in one process: mlx-lm's own GenerationBatch step against the worker's lean
step (worker/batching.py), on the same model, batch size and context length.

Two BatchGenerators hold `c` sequences each (prompts of `--prompt-tokens` random token
ids, no stop tokens); one keeps mlx-lm's step, the other gets the worker's `attach` with
`normalize` off, as the engine runs it when no request reads logprobs. They decode in
alternating blocks of `--steps` steps (the order flips every block), so both advance
through the same context lengths and a drifting machine slows both alike. Per level: the
median ms per step of each, and the median over blocks of the paired ratio lean / upstream
(below 1: the lean step is faster).

With `--fused`, the lean generator runs on a second copy of the model with the worker's
fused CPU ops swapped in (worker/cpu_ops.py, as the worker loads a model on MLX's CPU
device): the ratio is then the worker's whole decode step against mlx-lm's.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m benchmarks.decode_step --model /tmp/bench-llama
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any


def _generator(model: Any, prompts: list[list[int]], lean: bool) -> Any:
    from mlx_lm.generate import BatchGenerator

    from worker.batching import attach

    gen = BatchGenerator(
        model,
        max_tokens=1_000_000,
        stop_tokens=None,
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
        prefill_step_size=4096,
    )
    if lean:
        batch = attach(gen)
        if batch is None:
            raise SystemExit("mlx-lm's GenerationBatch has changed: no lean step to measure")
        batch.normalize = False
    gen.insert(prompts, max_tokens=[1_000_000] * len(prompts))
    while len(gen._generation_batch) < len(prompts):  # prefill, then the first tokens
        gen.next()
    for _ in range(3):
        gen.next()
    return gen


def _block(gen: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        gen.next()
    return (time.perf_counter() - start) / steps * 1000


def measure(
    model: Any,
    vocab: int,
    c: int,
    prompt_tokens: int,
    blocks: int,
    steps: int,
    lean_model: Any = None,
) -> dict[str, Any]:
    import mlx.core as mx

    rnd = random.Random(c)
    prompts = [[rnd.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(c)]
    gens = {
        "upstream": _generator(model, prompts, False),
        "lean": _generator(lean_model if lean_model is not None else model, prompts, True),
    }
    times: dict[str, list[float]] = {name: [] for name in gens}
    for i in range(blocks):
        for name in sorted(gens, reverse=bool(i % 2)):
            times[name].append(_block(gens[name], steps))
    for gen in gens.values():
        gen.close()
    mx.clear_cache()
    ratios = [lean / up for lean, up in zip(times["lean"], times["upstream"], strict=True)]
    return {
        "concurrency": c,
        "upstream_ms": statistics.median(times["upstream"]),
        "lean_ms": statistics.median(times["lean"]),
        "lean_vs_upstream": statistics.median(ratios),
        "blocks": times,
    }


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 100000: {value}")
    return value


def _levels(text: str) -> list[int]:
    return [_positive(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__)
    parser.add_argument("--model", required=True, help="model dir")
    parser.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=_positive, default=128)
    parser.add_argument("--blocks", type=_positive, default=16, help="blocks per step kind")
    parser.add_argument("--steps", type=_positive, default=20, help="decode steps per block")
    parser.add_argument(
        "--fused", action="store_true", help="the lean step on a model with the fused CPU ops"
    )
    parser.add_argument("--out", help="JSON with every block's time")
    args = parser.parse_args(argv)

    from mlx_lm import load

    loaded = load(args.model)
    model, tokenizer = loaded[0], loaded[1]
    vocab = len(tokenizer)
    lean_model = None
    if args.fused:
        from worker.cpu_ops import fuse_for_cpu

        lean_model = load(args.model)[0]
        if not fuse_for_cpu(lean_model):
            raise SystemExit("no fused CPU ops for this model or device")
    results = []
    print("| conc | upstream ms/step | lean ms/step | lean / upstream (paired median) |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        r = measure(model, vocab, c, args.prompt_tokens, args.blocks, args.steps, lean_model)
        r["fused"] = args.fused
        results.append(r)
        print(
            f"| {c} | {r['upstream_ms']:.2f} | {r['lean_ms']:.2f} | {r['lean_vs_upstream']:.3f} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "fused": args.fused, "levels": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
