"""What a worker's first requests pay on a machine where nothing is compiled yet, in one process.

    python -m benchmarks.first_use MODEL [--ptx-cache DIR] [--requests 400] [--inflight 32]
                                         [--slow-ms 300] [--label fresh]

MLX's CUDA backend compiles some kernels with NVRTC at their first use in a process and keeps
them in `MLX_PTX_CACHE_DIR` (`--ptx-cache` sets it for this process); the CUDA driver keeps the
code it builds from them in `CUDA_CACHE_PATH`. Run once with both pointing at empty folders
(a fresh install) and again with the same folders (every later load).

The engine, built as a worker builds it (the engine settings' defaults, max_running 64), runs
its load's probe (timed), then a closed loop of greedy requests, `--inflight` at a time
(prompts of 100-140 random tokens, outputs of 8-128, seeded), until `--requests` have finished.
Prints two JSON lines: the probe's time and the kernel modules compiled by then (files under
the PTX cache, by name, with the second they were written, from the probe's start), then the
loop's steps, the steps slower than `--slow-ms` (index, ms) and the modules compiled during the
loop (after the probe: what the first requests would have paid).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_use", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--ptx-cache", help="MLX_PTX_CACHE_DIR for this process (default: as set)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--inflight", type=int, default=32)
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--label", default="", help="added to each line (e.g. fresh, cached)")
    args = p.parse_args(argv)
    if min(args.requests, args.inflight) < 1 or args.slow_ms <= 0:
        p.error("--requests and --inflight must be at least 1, --slow-ms above 0")
    return args


def compiled(cache: Path | None, since: float) -> dict[str, float]:
    """The modules under the PTX cache: name -> seconds from `since` to when it was written."""
    if cache is None or not cache.is_dir():
        return {}
    found = sorted(cache.rglob("*.ptx"), key=lambda f: f.stat().st_mtime)
    return {f.stem: round(f.stat().st_mtime - since, 1) for f in found}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ptx_cache:
        os.environ["MLX_PTX_CACHE_DIR"] = args.ptx_cache  # before MLX first reads it
    cache_env = os.environ.get("MLX_PTX_CACHE_DIR")
    cache = Path(cache_env) if cache_env else None
    from shared.config import EngineOptions
    from shared.types import SamplingParams
    from worker.backends.mlx_lm import load, make_backend
    from worker.engine.core import EngineCore
    from worker.preprocess import PreparedRequest

    model, tokenizer = load(args.model)
    options = EngineOptions(max_running=64)
    engine = EngineCore(make_backend(model, tokenizer, options), options, None)
    label: dict[str, Any] = {"label": args.label} if args.label else {}
    started = time.time()
    engine.probe()
    probed = compiled(cache, started)
    line = {"probe_s": round(time.time() - started, 2), "compiled_by_probe": probed}
    print(json.dumps(label | line | {"ptx_cache": cache_env}), flush=True)

    rng = random.Random(0)
    vocab = min(100_000, len(tokenizer))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    added, steps, inflight = 0, 0, set()
    slow: list[tuple[int, float]] = []
    while added < args.requests or inflight:
        while len(inflight) < args.inflight and added < args.requests:
            prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(100, 140))]
            request_id = f"r{added}"
            engine.add(PreparedRequest(request_id, prompt, rng.randint(8, 128), greedy))
            inflight.add(request_id)
            added += 1
        begun = time.perf_counter()
        for output in engine.step():
            if output.finish_reason is not None:
                inflight.discard(output.request_id)
        engine.settle()  # as a worker does once a step's outputs are out
        steps += 1
        ms = 1000 * (time.perf_counter() - begun)
        if ms > args.slow_ms:
            slow.append((steps, round(ms)))
    after = {k: v for k, v in compiled(cache, started).items() if k not in probed}
    line = {"steps": steps, "slow_steps": slow, "compiled_after_probe": after}
    print(json.dumps(label | line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
