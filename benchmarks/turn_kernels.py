"""What the device ran in a cached turn: the kernels between a request's add and its first
token, in one process (the engine alone, as benchmarks/cached_turns.py runs an agent
trace's lengths, prefix cache on). MLX's CUDA backend only.

    python -m benchmarks.turn_kernels MODEL [--system 4096] [--turns 8] [--reply 64]
                                            [--idle-ms MS [--idle-spin]]

The kernels come from PyTorch's profiler, which records the process's CUDA activity through
CUPTI, every library's kernels included (MLX's, here); PyTorch is not one of the project's
dependencies (the GPU machines' images have it). `--warm` traces run unrecorded first (the
shapes met), then one trace runs recorded. One JSON line per recorded turn: `wall_ms` from
the add to the first token on the host, the `kernels` that started in that window, their
summed time (`busy_ms`), the `span_ms` from the first one's start to the last one's end,
`first_kernel_ms` (when the device began, after the add: the host's work before its first
kernel), `idle_ms` (the span less the busy time: the device waiting for the host) and the
`top` kernels by summed time, [name, count, ms]. The profiler slows the host: a recorded
turn takes longer than an unrecorded one (cached_turns.py measures those). A turn whose
first token is read after the next decode step was built shows that step's kernels
(matrix-vector products, the one-query attention) in its window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.cached_turns import add_trace_args, check_trace_args, run_trace
from shared.blas import mlx_worker_defaults

KERNEL_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
RANGE = "turn-"  # the profiler's range around a turn's add to first token
NAME_CHARS = 90


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.turn_kernels", description=__doc__)
    add_trace_args(p)  # cached_turns.py's: the same conversation, idle spells included
    p.add_argument("--warm", type=int, default=2, help="traces run unrecorded first")
    p.add_argument("--top", type=int, default=12, help="kernels listed per turn")
    p.add_argument("--trace-out", type=Path, help="keep the profiler's trace (Chrome JSON)")
    args = p.parse_args(argv)
    check_trace_args(p, args)
    if args.top < 1 or args.warm < 0:
        p.error("--top must be at least 1, --warm at least 0")
    return args


def turn_windows(events: list[dict[str, Any]], top: int = 12) -> list[dict[str, Any]]:
    """Per host range named RANGE..., in order: the device's kernels that started in it."""
    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(RANGE)),
        key=lambda e: e["ts"],
    )
    kernels = [e for e in events if e.get("cat") in KERNEL_KINDS]
    lines = []
    for r in ranges:
        start, end = r["ts"], r["ts"] + r["dur"]
        inside = [k for k in kernels if start <= k["ts"] < end]
        busy = sum(k["dur"] for k in inside)
        began = min(k["ts"] for k in inside) if inside else start
        span = max(k["ts"] + k["dur"] for k in inside) - began if inside else 0
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for k in inside:
            entry = by_name[k["name"][:NAME_CHARS]]
            entry[0] += 1
            entry[1] += k["dur"]
        ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
        lines.append(
            {
                "turn": int(r["name"][len(RANGE) :]),
                "wall_ms": round(r["dur"] / 1e3, 2),
                "kernels": len(inside),
                "busy_ms": round(busy / 1e3, 2),
                "span_ms": round(span / 1e3, 2),
                "first_kernel_ms": round((began - start) / 1e3, 2) if inside else None,
                "idle_ms": round(max(0.0, span - busy) / 1e3, 2),
                "top": [[name, int(n), round(us / 1e3, 3)] for name, (n, us) in ranked],
            }
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mlx_worker_defaults(os.environ)  # before MLX: the engine as a worker runs it
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        print("turn_kernels needs PyTorch (its profiler records the kernels)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("turn_kernels needs a CUDA device (MLX's CUDA backend)", file=sys.stderr)
        return 2
    from shared.config import EngineOptions
    from worker.backends.mlx_lm import load, make_backend
    from worker.engine.core import EngineCore

    model, tokenizer = load(args.model)
    options = EngineOptions(max_running=8, prefill_batch_size=8, prefix_cache=True)
    engine = EngineCore(make_backend(model, tokenizer, options), options)
    for trace in range(args.warm):
        run_trace(engine, "warm", trace, args)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        turns = run_trace(
            engine, "kernels", args.warm, args, lambda t: record_function(f"{RANGE}{t}")
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace_out or Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    for line in turn_windows(events, args.top):
        t = line["turn"]
        extra = {"prompt": turns["prompt"][t], "cached": turns["cached"][t], "ms": turns["ms"][t]}
        print(json.dumps({**line, **extra}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
