"""What starting sequences at different steps costs mlx-lm's BatchGenerator, in one process.

    python -m benchmarks.arrivals MODEL --concurrency 64,128 --requests 512

Keeps `c` sequences in flight and replaces each finished one, two ways:
- waves: every sequence has the same length and its replacement starts at once, so the
  whole batch starts and ends together (what the in-process ceiling of `serving.py` does);
- spread: lengths vary (96-160 tokens) and each replacement starts 1-3 steps later (a
  client's round trip), so new sequences join at almost every step, as at a server.
Each start costs the running batch BatchGenerator's forward pass over the new prompts and a
separate first step for the new rows; where a step is bound by the host's time to build and
launch it (MLX's CUDA backend), spread arrivals cost the batch several steps' worth each.
Prints one JSON line per (concurrency, mode): decode tokens/s after a warm-up of 50 steps,
mean step time and the median time from insert to first token.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

MODES = ("waves", "spread")
WARM_STEPS = 50
PROMPT_TOKENS = 128


def run(model: Any, vocab: int, concurrency: int, requests: int, mode: str) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator

    rng = random.Random(0)
    gen = BatchGenerator(
        model,
        max_tokens=128,
        stop_tokens=None,
        completion_batch_size=concurrency,
        prefill_batch_size=concurrency,
        prefill_step_size=2048,
    )
    inserted: dict[int, float] = {}
    ttft: list[float] = []

    def start(k: int) -> None:
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(k)]
        lengths = [128 if mode == "waves" else rng.randrange(96, 161) for _ in range(k)]
        now = time.perf_counter()
        for uid in gen.insert(prompts, max_tokens=lengths):
            inserted[uid] = now

    start(concurrency)
    started, done, tokens, steps = concurrency, 0, 0, 0
    due: list[int] = []  # the step at which each replacement arrives
    t0, tokens0, steps0 = 0.0, 0, 0
    max_steps = (requests + concurrency) * 200
    while done < requests and steps < max_steps:
        _, responses = gen.next()
        steps += 1
        now = time.perf_counter()
        finished = 0
        for r in responses:
            if r.uid in inserted:
                ttft.append(now - inserted.pop(r.uid))
            finished += r.finish_reason is not None
        tokens += len(responses)
        done += finished
        if steps == WARM_STEPS:
            t0, tokens0, steps0 = now, tokens, steps
        due += [steps + (0 if mode == "waves" else rng.randrange(1, 4)) for _ in range(finished)]
        ready = sum(1 for d in due if d <= steps)
        due = [d for d in due if d > steps]
        ready = min(ready, requests + concurrency - started)
        if ready > 0:
            start(ready)
            started += ready
    elapsed = time.perf_counter() - t0 if t0 else float("nan")
    gen.close()
    ttft.sort()
    return {
        "concurrency": concurrency,
        "mode": mode,
        "tok_s": round((tokens - tokens0) / elapsed, 1),
        "step_ms": round(elapsed / max(1, steps - steps0) * 1e3, 3),
        "ttft_p50_ms": round(ttft[len(ttft) // 2] * 1e3, 1) if ttft else None,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--requests", type=int, default=512, help="finished sequences per run")
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency takes integers separated by commas, not {args.concurrency!r}")
    if min(levels) < 1 or args.requests < 1:
        p.error("--concurrency and --requests must be at least 1")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r} (one of {', '.join(MODES)})")
    from mlx_lm import load

    model, tokenizer = load(args.model)
    vocab = len(tokenizer)
    for c in levels:
        for mode in modes:
            print(json.dumps(run(model, vocab, c, args.requests, mode)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
