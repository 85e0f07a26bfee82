"""Summary of the engine's step timeline (`MLX_GATEWAY_STEP_TRACE`, worker/steptrace.py):
where a served worker's time went during each measured level of benchmarks.serving.

    python -m benchmarks.step_trace TRACE_DIR [--serving OUT.json | --starts]

With --starts, one line per step that started requests (`starts`: what a served turn's
first step took against the engine alone's, and how long the worker sat idle before it).
With --serving, one line per source and level: the steps that started inside the level's
window (`window` in each run of the serving JSON). Without it, one line per trace file.
Per line, as shares of the window's wall time: in steps and the settles after them (`step`;
of it, the backend's forward pass and token wait, `backend`; a settle counts as if it came
right after its step, though it runs once the step's outputs are sent), between steps while
requests were in the batch (`between`: the worker emitting deltas and taking requests in)
and with none (`empty`: waiting for requests, and the wall time outside any step before
the first and after the last). And
the median step without and with requests starting in it, how often requests started (per
100 steps) and how many at a time, the mean requests in the batch (prefilling or decoding)
over the steps that had any. On the rows batch, the median plain step with an attention
mask (rows of different lengths) and without, the share of plain steps with one, the
steps in which the compiled decode step met a row count for the first time (a new trace),
and the median wait of a plain step for the previous step's tokens (`plain_wait_ms`: the
rest of its backend time is the host building the step). `leaving`: the share of the wall
time spent outside the backend in steps where rows left the batch and in the settles after
them (their KV going into the prefix cache, worker/backends/shelves.py); `settle` and
`settle_ms`: the settles' share (the engine's work put off until a step's outputs were
out) and their median where they did any. `read_aheads`: the rows batch's calls that only
read the pending tokens ahead of a prefill. A plain step inserts no request, runs no prompt
positions and joins no row (on the rows batch the last two come a step or more after the
insertion: `prefill_steps_per_100`, `prefill_step_ms` and `prefill_positions` give the steps
that ran prompt positions, their median time and positions). `plain_batch_rows`
and `plain_kv_size`: the rows batch's median rows (those that left but still decode
included) and KV length in positions over its plain steps: what a plain step computes over.
`plain_cpu_ms` and `plain_off_cpu_ms`: a plain step's median CPU time on the engine's thread
and the median rest of it (waiting for the device, for a lock such as Python's, or
preempted), with the thread's voluntary and involuntary context switches per 100 plain
steps; `cache_mb`: MLX's median buffer cache over the steps, in MiB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# [t, step_ms, backend_ms, inserted, insert_ms, rows, outputs, masked, new_shapes, wait_ms,
#  read_ahead, batch_rows, kv_size, prefilled, joined, cpu_ms, voluntary, involuntary, cache_mb,
#  settle_ms]
(T, STEP, BACKEND, INSERTED, INSERT, ROWS, OUTPUTS, MASKED, SHAPES, WAIT, AHEAD) = range(11)
BATCH, KV, PREFILLED, JOINED, CPU, VOLUNTARY, INVOLUNTARY, CACHE, SETTLE = range(11, 20)


def _field(step: list[Any], at: int) -> Any:
    return step[at] if len(step) > at else None  # traces of older workers have 7 fields


def read_traces(folder: Path) -> dict[str, list[list[float]]]:
    traces = {}
    for path in sorted(folder.glob("steps-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        traces[path.name] = sorted(rows, key=lambda r: r[T])
    return traces


def took(step: list[Any]) -> float:
    """ms: the step and its settle (the work it put off)."""
    return float(step[STEP]) + (_field(step, SETTLE) or 0.0)


def summarize(
    steps: list[list[float]], start: float | None = None, end: float | None = None
) -> dict[str, Any] | None:
    """Shares of [start, end] (default: the first step's start to the last one's end)."""
    if not steps:
        return None

    first, last = steps[0], steps[-1]
    start = first[T] if start is None else start
    end = last[T] + took(last) / 1e3 if end is None else end
    wall = max(end - start, 1e-9)
    step_s = sum(took(s) for s in steps) / 1e3
    backend_s = sum(s[BACKEND] for s in steps) / 1e3
    between = 0.0
    for prev, nxt in itertools.pairwise(steps):
        gap = nxt[T] - (prev[T] + took(prev) / 1e3)
        if prev[ROWS] > 0:  # rows were waiting for their next step
            between += max(gap, 0.0)
    # no request inserted, no prompt run, no row joined (the rows batch prefills and joins
    # rows a step or more after their insertion), not a read-ahead
    plains = [
        s
        for s in steps
        if not s[INSERTED]
        and not _field(s, AHEAD)
        and not _field(s, PREFILLED)
        and not _field(s, JOINED)
    ]
    prefills = [s for s in steps if _field(s, PREFILLED)]
    plain = [s[STEP] for s in plains]
    joins = [s for s in steps if s[INSERTED]]
    masked = [s[STEP] for s in plains if _field(s, MASKED) == 1]
    unmasked = [s[STEP] for s in plains if _field(s, MASKED) == 0]
    traced = [s for s in steps if _field(s, SHAPES)]
    waits = [w for s in plains if (w := _field(s, WAIT)) is not None]
    leaving = sum(  # rows fewer after the step than before it and those it started
        nxt[STEP] - nxt[BACKEND] + (_field(nxt, SETTLE) or 0.0)
        for prev, nxt in itertools.pairwise(steps)
        if nxt[ROWS] < prev[ROWS] + nxt[INSERTED]
    )
    settles = [m for s in steps if (m := _field(s, SETTLE))]
    decoding = [s[ROWS] for s in steps if s[ROWS]]
    batch_rows = [b for s in plains if (b := _field(s, BATCH)) is not None]
    kv = [k for s in plains if (k := _field(s, KV)) is not None]
    cpu = [(s[STEP], c) for s in plains if (c := _field(s, CPU)) is not None]
    switched = [
        (v, i)
        for s in plains
        if (v := _field(s, VOLUNTARY)) is not None and (i := _field(s, INVOLUNTARY)) is not None
    ]
    cache = [c for s in steps if (c := _field(s, CACHE)) is not None]

    def median(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 2) if xs else None

    return {
        "steps": len(steps),
        "wall_s": round(wall, 3),
        "step": round(step_s / wall, 3),
        "backend": round(backend_s / wall, 3),
        "between": round(between / wall, 3),
        "empty": round(max(0.0, 1 - (step_s + between) / wall), 3),
        "plain_step_ms": median(plain),
        "join_step_ms": median([s[STEP] for s in joins]),
        "insert_ms": median([s[INSERT] for s in joins]),
        "joins_per_100": round(100 * len(joins) / len(steps), 1),
        "joiners": round(statistics.mean(s[INSERTED] for s in joins), 1) if joins else 0,
        "mean_rows": round(statistics.mean(decoding), 1) if decoding else 0,
        # the rows batch: plain steps over rows of different lengths (an attention mask)
        # and of one length; steps in which the compiled step met a new row count
        "plain_masked_ms": median(masked),
        "plain_unmasked_ms": median(unmasked),
        "masked_share": round(len(masked) / len(plain), 3) if plain and masked else 0,
        "new_shape_steps": len(traced),
        "new_shape_step_ms": median([s[STEP] for s in traced]),
        "plain_wait_ms": median(waits),
        # the host's work where rows left the batch (in the step, and in the settle after
        # it once its outputs were out); the settles' share and median where one did work
        "leaving": round(leaving / 1e3 / wall, 3),
        "settle": round(sum(settles) / 1e3 / wall, 3),
        "settle_ms": median(settles),
        "read_aheads": sum(1 for s in steps if _field(s, AHEAD)),
        # the rows batch's plain steps: its rows (those left but decoding on included) and
        # its KV's length in positions
        "plain_batch_rows": median(batch_rows),
        "plain_kv_size": median(kv),
        # the rows batch's steps that ran prompt positions: how many, and their median
        "prefill_steps_per_100": round(100 * len(prefills) / len(steps), 1),
        "prefill_step_ms": median([s[STEP] for s in prefills]),
        "prefill_positions": median([s[PREFILLED] for s in prefills]),
        # the plain steps on the engine's thread: its CPU time, the rest of the step off the
        # CPU (the device, a lock, preemption), and its context switches per 100 steps
        "plain_cpu_ms": median([c for _, c in cpu]),
        "plain_off_cpu_ms": median([ms - c for ms, c in cpu]),
        "plain_voluntary_per_100": per_100([v for v, _ in switched]),
        "plain_involuntary_per_100": per_100([i for _, i in switched]),
        "cache_mb": median(cache),
    }


def starts(steps: list[list[Any]]) -> list[dict[str, Any]]:
    """One line per step that started requests (a turn's first step when one request runs
    at a time): the worker's idle spell before it (from the step before's end, its settle
    included; None for the first step), the step's time and the engine thread's CPU time in
    it, the backend's part and the insertion's, the prompt positions it ran (the rows
    batch; padding included) and the KV's length after it."""
    lines = []
    for i, step in enumerate(steps):
        if not step[INSERTED]:
            continue
        before = steps[i - 1] if i else None
        idle = None if before is None else 1e3 * (step[T] - before[T]) - took(before)
        lines.append(
            {
                "t": step[T],
                "idle_ms": None if idle is None else round(idle, 2),
                "step_ms": step[STEP],
                "cpu_ms": _field(step, CPU),
                "backend_ms": step[BACKEND],
                "insert_ms": step[INSERT],
                "started": step[INSERTED],
                "prefilled": _field(step, PREFILLED),
                "kv_size": _field(step, KV),
            }
        )
    return lines


def per_100(counts: list[int]) -> float | None:
    return round(100 * sum(counts) / len(counts), 1) if counts else None


def per_level(
    traces: dict[str, list[list[float]]], serving: dict[str, Any]
) -> list[dict[str, Any]]:
    every = sorted((s for steps in traces.values() for s in steps), key=lambda s: s[T])
    lines = []
    for model in serving.get("models", {}).values():
        for source, result in model.get("targets", {}).items():
            for level in result.get("levels", []):
                for run in level.get("runs", [level]):
                    window = run.get("window")
                    if not window:
                        continue
                    start, end = window
                    inside = [s for s in every if start <= s[T] < end]
                    summary = summarize(inside, start, end)
                    if summary is not None:
                        lines.append(
                            {"source": source, "concurrency": level["concurrency"], **summary}
                        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_trace", description=__doc__)
    p.add_argument("trace_dir", type=Path)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--serving", type=Path, help="benchmarks.serving's JSON (level windows)")
    which.add_argument(
        "--starts",
        action="store_true",
        help="a line per step that started requests (the idle spell before it, its CPU time)",
    )
    args = p.parse_args(argv)
    traces = read_traces(args.trace_dir)
    if not traces:
        print(f"no steps-*.jsonl in {args.trace_dir}", file=sys.stderr)
        return 1
    if args.starts:
        lines = [{"file": name, **line} for name, steps in traces.items() for line in starts(steps)]
    elif args.serving is not None:
        lines = per_level(traces, json.loads(args.serving.read_text()))
    else:
        lines = [{"file": name, **(summarize(steps) or {})} for name, steps in traces.items()]
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
