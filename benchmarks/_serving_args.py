"""The serving benchmark's command line: its flags, their checks, and the per-target
request fields (`benchmarks/serving.py` runs what they ask for)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{flag} expects NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", action="append", default=[], help="model dir (repeatable)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL")
    p.add_argument(
        "--served-model",
        action="append",
        default=[],
        metavar="[NAME=]ID",
        help="model id to send in requests (per target with NAME=)",
    )
    p.add_argument(
        "--launch",
        nargs="?",
        const="mlx_lm,vllm_mlx",
        default=None,
        metavar="NAMES",
        help="launch built-in servers (default mlx_lm,vllm_mlx)",
    )
    p.add_argument(
        "--launch-cmd",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="launch CMD; fills {port} {model} {max_concurrency} {python} {vllm_mlx_cmd}",
    )
    p.add_argument("--vllm-mlx-cmd", default=None, help="vllm-mlx executable")
    p.add_argument(
        "--inprocess",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL_PATH",
        help="measure mlx_lm BatchGenerator in-process (default: each --model)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for prompt calibration")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument(
        "--requests", type=int, default=None, help="per level (default max(4c, --min-requests))"
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=32,
        help="floor of the default requests per level: short low-concurrency levels are the "
        "noisiest on a shared machine (default 32)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument(
        "--extra-body",
        action="append",
        default=[],
        metavar="[NAME=]JSON",
        help="fields merged into every request body (per target with NAME=), e.g. "
        '\'lp={"logprobs": true, "top_logprobs": 5}\'',
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--warm-levels",
        action="store_true",
        help="run every level once, unrecorded, before measuring (each source and the"
        " ceiling): kernels a GPU backend compiles on first use of a shape (MLX CUDA) are"
        " then built before the measurement, as on a server that has been up a while",
    )
    p.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="run every level of one source before the next source (default: level by "
        "level, all sources back to back, order reversed on odd repeats)",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="only print the tables of a run's --out file (one cut short included) and exit",
    )
    p.add_argument("--blas", default="auto", help="auto | off | path of a BLAS to LD_PRELOAD")
    p.add_argument("--level-timeout", type=float, default=300.0, help="seconds per level run")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=60.0,
        help="before each source, wait up to this many seconds for the machine to go idle",
    )
    p.add_argument(
        "--client-nice",
        type=int,
        default=10,
        help="nice value of the load-generator thread (Linux; 0 = same priority as servers)",
    )
    p.add_argument("--idle-threshold", type=float, default=30.0, help="idle: < this CPU %%")
    p.add_argument(
        "--max-steal",
        type=float,
        default=15.0,
        help="a level measured while a virtual machine's host withheld more than this CPU "
        "(steal time, %% of one core) is measured again with fresh prompts",
    )
    p.add_argument(
        "--steal-retries",
        type=int,
        default=2,
        help="how many times a level is measured again for steal (0: never)",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temp)")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    p.add_argument("--raw", action="store_true", help="include per-request records in JSON")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not args.levels or min(args.levels) < 1 or max(args.levels) > 512:
        p.error("--concurrency: integers in 1..512")
    if args.repeats < 1 or args.repeats > 20:
        p.error("--repeats: 1..20")
    if not 0 <= args.steal_retries <= 10:
        p.error("--steal-retries: 0..10")
    launching = args.launch is not None or bool(args.launch_cmd)
    if launching and not args.model:
        p.error("--launch/--launch-cmd need --model")
    if args.inprocess == "" and not args.model:
        p.error("--inprocess without a path needs --model")
    if not (args.target or launching or args.inprocess is not None or args.report):
        p.error("nothing to measure: give --target, --launch, --launch-cmd or --inprocess")
    return args


def extra_body(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """--extra-body for the target `name` (a NAME= entry wins over one for all targets)."""
    chosen: dict[str, Any] = {}
    for item in args.extra_body:
        key, sep, text = item.partition("=")
        if sep and not key.lstrip().startswith("{") and key == name:
            return dict(json.loads(text))
        if not sep or key.lstrip().startswith("{"):
            chosen = dict(json.loads(item))
    return chosen
