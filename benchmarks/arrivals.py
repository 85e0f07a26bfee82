"""What starting sequences at different steps costs mlx-lm's BatchGenerator, in one process.

    python -m benchmarks.arrivals MODEL --concurrency 64,128 --requests 512
    python -m benchmarks.arrivals MODEL --modes join --concurrency 48 --join 1,16,64
    python -m benchmarks.arrivals MODEL --concurrency 64 --batchers mlx_lm,rows
    python -m benchmarks.arrivals MODEL --concurrency 128 --batchers rows --settle 0,2

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

The join mode takes one start apart: `c` sequences decode, then `k` new 128-token prompts
(each with max_tokens 1: they join and leave) are inserted and the generator is stepped
until every one has its token. Each k is joined JOIN_REPEATS times: the first meets new
shapes (MLX's CUDA backend compiles kernels on a shape's first use), the others reuse them.
One JSON line per (c, k): the first join's time, the median of the others, the calls to
next() a join took, and what that many plain decode steps take.

Every mode runs on each of `--batchers`: mlx-lm's BatchGenerator and the project's rows
batch (worker/backends/rows.py), the latter once for each of `--settle` (its
`settle_steps`, `engine.join_settle_steps`: 0, the default, joins a big enough group at
once; n waits for n steps without an arrival).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

MODES = ("waves", "spread", "join")
JOIN_REPEATS = 4
WARM_STEPS = 50
PROMPT_TOKENS = 128


@dataclass(slots=True)
class _Response:
    uid: int
    finish_reason: str | None


class _Rows:
    """The project's own batch (worker/backends/rows.py) behind BatchGenerator's insert and
    next: rows leave when they have their max_tokens, as a server's engine removes them."""

    def __init__(self, model: Any, prefill_step_size: int, settle: int = 0) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        from worker.backends.rows import RowBatch
        from worker.backends.sampling import greedy

        self.batch = RowBatch(model, prefill_step_size, settle_steps=settle)
        self.new_cache = lambda: make_prompt_cache(model)
        self.greedy = greedy
        self.left: dict[int, int] = {}

    def insert(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        n = len(prompts)
        uids = self.batch.insert(
            prompts, [self.new_cache() for _ in prompts], [[]] * n, [self.greedy] * n, [[]] * n
        )
        self.left.update(zip(uids, max_tokens, strict=True))
        return uids

    def next(self) -> tuple[list[Any], list[_Response]]:
        responses, done = [], []
        for uid, _, _ in self.batch.step(logprobs=False):  # as the worker: none asked
            self.left[uid] -= 1
            ended = self.left[uid] <= 0
            responses.append(_Response(uid, "length" if ended else None))
            if ended:
                done.append(uid)
                del self.left[uid]
        if done:
            self.batch.remove(done)
        return [], responses

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Batcher:
    """What a run decodes on: mlx-lm's BatchGenerator, or the rows batch with a settle."""

    name: str = "mlx_lm"
    settle: int = 0

    def generator(self, model: Any, size: int) -> Any:
        """BatchGenerator, or the rows batch behind its insert and next."""
        from mlx_lm.generate import BatchGenerator

        if self.name == "rows":
            return _Rows(model, 2048, self.settle)
        return BatchGenerator(
            model,
            max_tokens=128,
            stop_tokens=None,
            completion_batch_size=size,
            prefill_batch_size=size,
            prefill_step_size=2048,
        )

    def label(self) -> dict[str, Any]:
        if self.name != "rows":
            return {"batcher": self.name}
        return {"batcher": self.name, "settle": self.settle}


def run(
    model: Any,
    vocab: int,
    concurrency: int,
    requests: int,
    mode: str,
    batcher: Batcher = Batcher(),
) -> dict[str, Any]:
    rng = random.Random(0)
    gen = batcher.generator(model, concurrency)
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
        **batcher.label(),
        "tok_s": round((tokens - tokens0) / elapsed, 1),
        "step_ms": round(elapsed / max(1, steps - steps0) * 1e3, 3),
        "ttft_p50_ms": round(ttft[len(ttft) // 2] * 1e3, 1) if ttft else None,
        "steps": steps,
    }


def join_cost(
    model: Any, vocab: int, concurrency: int, k: int, batcher: Batcher = Batcher()
) -> dict[str, Any]:
    rng = random.Random(k)
    gen = batcher.generator(model, concurrency + k)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(n)]

    def steps(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            gen.next()
        return time.perf_counter() - t

    gen.insert(prompts(concurrency), max_tokens=[10**9] * concurrency)
    steps(WARM_STEPS // 2)
    joins: list[float] = []
    calls = 0
    for _ in range(JOIN_REPEATS):
        waiting = set(gen.insert(prompts(k), max_tokens=[1] * k))
        t, calls = time.perf_counter(), 0
        while waiting and calls < 100:
            _, responses = gen.next()
            calls += 1
            waiting.difference_update(r.uid for r in responses)
        joins.append(time.perf_counter() - t)
    plain = min(steps(calls) for _ in range(3))
    gen.close()
    reuse = sorted(joins[1:])
    return {
        "concurrency": concurrency,
        "mode": "join",
        **batcher.label(),
        "k": k,
        "first_ms": round(joins[0] * 1e3, 1),
        "reuse_ms": round(reuse[len(reuse) // 2] * 1e3, 1),
        "next_calls": calls,
        "plain_steps_ms": round(plain * 1e3, 1),
    }


def _levels(p: argparse.ArgumentParser, text: str, flag: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{flag} takes integers separated by commas, not {text!r}")
    if min(levels) < 1:
        p.error(f"{flag} must be at least 1")
    return levels


def _counts(p: argparse.ArgumentParser, text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{flag} takes integers separated by commas, not {text!r}")
    if min(values) < 0:
        p.error(f"{flag} must be at least 0")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--requests", type=int, default=512, help="finished sequences per run")
    p.add_argument("--modes", default="waves,spread")
    p.add_argument("--join", default="1,16", help="join mode: prompts a join inserts")
    p.add_argument(
        "--batchers",
        default="mlx_lm",
        help="mlx-lm's BatchGenerator and/or the project's rows batch (every mode)",
    )
    p.add_argument(
        "--settle",
        default="0",
        help="the rows batch's settle_steps (worker/backends/rows.py), one run for each",
    )
    args = p.parse_args(argv)
    levels = _levels(p, args.concurrency, "--concurrency")
    sizes = _levels(p, args.join, "--join")
    if args.requests < 1:
        p.error("--requests must be at least 1")
    batchers = args.batchers.split(",")
    if any(b not in ("mlx_lm", "rows") for b in batchers):
        p.error(f"--batchers takes mlx_lm and/or rows, not {args.batchers!r}")
    settles = _counts(p, args.settle, "--settle")
    variants = [
        Batcher(b, settle) for b in batchers for settle in (settles if b == "rows" else [0])
    ]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r} (one of {', '.join(MODES)})")
    from mlx_lm import load

    model, tokenizer = load(args.model)
    vocab = len(tokenizer)
    for c in levels:
        for mode in modes:
            rows = (
                [join_cost(model, vocab, c, k, variant) for variant in variants for k in sizes]
                if mode == "join"
                else [run(model, vocab, c, args.requests, mode, variant) for variant in variants]
            )
            for row in rows:
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
