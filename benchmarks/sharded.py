"""Sharded-model benchmark: time per output token of a model served by one worker process
and by ``--shards`` processes in one mlx.distributed group (tensor parallel, or with
``--sharding pipeline`` each rank its own layers; the ring backend on loopback), through the
gateway, at concurrency 1 (one person, one agent) and
``--concurrency``.

One gateway serves ``--model`` twice (as ``single`` and as ``sharded``); the two are measured
alternately, level by level, ``--repeats`` times, with unique prompts (no prefix cache hits).
Per level: inter-token latency p50 (ms per token after the first) and output tok/s, medians
over the repeats, and the ratio sharded / single. Run from the repository root::

    python -m benchmarks.sharded --model /tmp/bench-llama --shards 2 --repeats 3
    python -m benchmarks.sharded --model /tmp/bench-qwen2 --sharding pipeline

All traffic goes to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _client, _launch
from benchmarks._prompts import make_prompts
from benchmarks._stats import machine_header, machine_info, summarize_level

NAMES = ("single", "sharded")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model dir")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--sharding", choices=("tensor", "pipeline"), default="tensor")
    p.add_argument("--concurrency", type=int, default=8, help="the second level")
    p.add_argument("--requests", type=int, default=8, help="per level run at c = 1")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--level-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    return p.parse_args(argv)


def write_config(
    path: Path, run_dir: Path, model: str, shards: int, sharding: str = "tensor"
) -> Path:
    lines = [
        "[server]",
        f'run_dir = "{run_dir}"',
        f'keys_file = "{run_dir}/keys.json"',
        "drain_timeout_s = 3.0",
    ]
    for name, n in zip(NAMES, (1, shards), strict=True):
        lines += ["", "[[models]]", f'name = "{name}"', f'source = "{model}"', f"shards = {n}"]
        lines += [f'sharding = "{sharding}"'] if n > 1 else []
    path.write_text("\n".join(lines) + "\n")
    return path


async def level(url: str, name: str, c: int, n: int, tag: str, args: Any) -> dict[str, Any]:
    prompts = make_prompts(0, n, tag, args.prompt_tokens, None)
    async with _client.make_client(c, 300.0) as client:
        records, wall = await _client.run_level(
            client, url, name, prompts, c, args.max_tokens, True, args.level_timeout
        )
    return summarize_level(records, wall, c, args.max_tokens)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {name: {} for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="sharded") as tmp:
        config = write_config(
            Path(tmp) / "gateway.toml",
            _launch.gateway_run_dir(),
            args.model,
            args.shards,
            args.sharding,
        )
        env = _launch.child_env(_launch.resolve_blas("auto"))
        fields = {"python": sys.executable, "config": str(config)}
        server = _launch.Server("gateway", _launch.GATEWAY_COMMAND, fields, env, Path(tmp))
        try:
            server.wait_ready(args.ready_timeout)
            _launch.wait_models_ready(server.url, args.ready_timeout)
            levels = [(1, args.requests), (args.concurrency, 4 * args.concurrency)]
            for name in NAMES:  # warm: every shape once, unrecorded
                for c, n in levels:
                    await level(server.url, name, c, n, f"warm-{name}-{c}", args)
            for repeat in range(args.repeats):
                order = NAMES if repeat % 2 == 0 else NAMES[::-1]
                for c, n in levels:
                    for name in order:
                        summary = await level(server.url, name, c, n, f"r{repeat}-{name}-{c}", args)
                        results[name].setdefault(str(c), []).append(summary)
        finally:
            server.stop()
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    def med(name: str, c: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name][c] if r.get(key) is not None)

    lines = [
        f"{args.shards} shards vs one process, {args.max_tokens} tokens per request, "
        f"{args.repeats} repeats (medians)",
        "",
        "| concurrency | single ms/token | sharded ms/token | single tok/s | sharded tok/s | "
        "sharded / single tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for c in results["single"]:
        one, many = med("single", c, "output_tok_s"), med("sharded", c, "output_tok_s")
        lines.append(
            f"| {c} | {med('single', c, 'itl_p50_ms'):.2f} | {med('sharded', c, 'itl_p50_ms'):.2f}"
            f" | {one:.0f} | {many:.0f} | {many / one:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(machine_header(machine_info(_launch.resolve_blas("auto"))))
    results = asyncio.run(run(args))
    print(report(results, args))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
