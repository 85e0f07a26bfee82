"""An agent session's turns in one process: the engine alone, with its prefix cache and
without, the time from `add` to each turn's first token. What the engine itself takes for
a cached turn, against which `benchmarks/agent_session.py`'s served turns (and their
per-turn worker share) say what serving adds.

    python -m benchmarks.cached_turns MODEL --system 4096 --turns 8

Each trace is one conversation: a first prompt of SYSTEM tokens, then each turn the whole
history (the prompt, the reply it got, greedy, REPLY tokens) and a new message of 150 tokens
and 7 more each turn (an agent's tool results), as token ids (no template, no tokenizer
cost). Every setting runs TRACES traces of other ids and the same lengths, one after the
other: the first meets the shapes for the first time (as a fresh server), the later ones
meet them again (as an always-on one). Prints one JSON line per setting and trace: the
first-token ms of each turn and the cached tokens each turn found. `--idle-ms` leaves the
engine out of work that long before each later turn, as a client's pause does a served
worker (asleep, or with `--idle-spin` spinning on the CPU: whether an idle spell slows the
turn after it, and whether the thread's sleep is why).

MLX runs as a worker runs it (under CUDA, off cuDNN's attention; on a CPU, OpenBLAS
preloaded: it re-executes itself under a worker's environment, benchmarks/_launch.py
`as_worker`) unless the environment says otherwise: `MLX_CUDA_USE_CUDNN_SDPA=1` measures
cuDNN's (each line says which, `cudnn_sdpa`). With `MLX_GATEWAY_STEP_TRACE` set to a folder,
the engine's steps are timed there as a worker's are (worker/steptrace.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from benchmarks import _launch
from shared.blas import CUDNN_SDPA, mlx_worker_defaults

# each setting's engine options beside the trace's batch limits; "-mlxattn": the prefill's
# attention MLX's, not the project's kernel (engine.prefill_attention = "mlx")
SETTINGS: dict[str, dict[str, Any]] = {
    "cache": {"prefix_cache": True},
    "nocache": {"prefix_cache": False},
    "cache-mlxattn": {"prefix_cache": True, "prefill_attention": "mlx"},
    "nocache-mlxattn": {"prefix_cache": False, "prefill_attention": "mlx"},
}
VOCAB = 400  # ids drawn below this (and above the first few, often special)


def _settings(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"settings are {', '.join(SETTINGS)}; not {unknown}")
    return names


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The conversation's arguments, shared with benchmarks/turn_kernels.py (`run_trace`)."""
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--system", type=int, default=4096, help="the first prompt's tokens")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reply", type=int, default=64, help="tokens of each reply")
    p.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="the engine idle this long before each turn after the first (a client's pause)",
    )
    p.add_argument(
        "--idle-spin",
        action="store_true",
        help="spend the idle spell spinning on the CPU instead of asleep",
    )


def check_trace_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.system, args.turns, args.reply) < 1:
        p.error("--system, --turns and --reply must be at least 1")
    if not 0 <= args.idle_ms <= 60_000:
        p.error("--idle-ms must be between 0 and 60000")
    if args.idle_spin and not args.idle_ms:
        p.error("--idle-spin spins through the --idle-ms spell: give one")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cached_turns", description=__doc__)
    add_trace_args(p)
    p.add_argument("--traces", type=int, default=2, help="traces a setting, one after another")
    p.add_argument(
        "--settings",
        type=_settings,
        default=["cache", "nocache"],
        help=f"comma-separated, of {', '.join(SETTINGS)}",
    )
    args = p.parse_args(argv)
    check_trace_args(p, args)
    if args.traces < 1:
        p.error("--traces must be at least 1")
    return args


def _ids(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % (VOCAB - 5) + 5 for i in range(length)]


def _turn(
    engine: Any,
    request_id: str,
    prompt: list[int],
    tokens: int,
    window: AbstractContextManager[Any] | None = None,
) -> tuple[float, list[int], int]:
    """One greedy turn of `tokens`: (ms to its first token, the reply's ids, cached tokens).
    `window` is entered at the add and left once the first token is out (a profiler's
    range: benchmarks/turn_kernels.py)."""
    from shared.types import SamplingParams
    from worker.preprocess import PreparedRequest

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    started, first, reply = time.perf_counter(), 0.0, []
    with ExitStack() as opened:  # the window left at the first token, or on the way out
        if window is not None:
            opened.enter_context(window)
        engine.add(PreparedRequest(request_id, prompt, tokens, greedy))
        for _ in range(100 * tokens):  # bounded: a reply takes about `tokens` steps
            done = None
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.token_ids and not first:
                    first = 1000 * (time.perf_counter() - started)
                    opened.close()
                reply += out.token_ids
                if out.finish_reason is not None:
                    done = first, reply, out.usage.cached_tokens if out.usage else 0
            engine.settle()  # as a worker does once a step's outputs are out (its KV stored)
            if done is not None:
                return done
    raise RuntimeError(f"{request_id}: no reply in {100 * tokens} steps")


def _idle(seconds: float, spin: bool) -> None:
    """The engine out of work for `seconds`: this thread asleep, or spinning on the CPU."""
    if not spin:
        time.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def run_trace(
    engine: Any,
    label: str,
    trace: int,
    args: argparse.Namespace,
    window: Callable[[int], AbstractContextManager[Any] | None] = lambda t: None,
) -> dict[str, list[Any]]:
    """Trace number `trace` of the conversation (`args`: system, turns, reply): each turn's
    prompt length, ms to its first token and cached tokens; `window(t)` as `_turn` takes it."""
    history = _ids(1000 * trace + 1, args.system)
    line: dict[str, list[Any]] = {"prompt": [], "ms": [], "cached": []}
    for t in range(args.turns):
        if t:
            _idle(args.idle_ms / 1e3, args.idle_spin)
        ms, reply, hit = _turn(engine, f"{label}-{trace}-{t}", history, args.reply, window(t))
        line["prompt"].append(len(history))
        line["ms"].append(round(ms, 2))
        line["cached"].append(hit)
        history = history + reply + _ids(1000 * trace + t + 2, 150 + 7 * t)
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _launch.as_worker("benchmarks.cached_turns", argv)
    mlx_env = mlx_worker_defaults(os.environ)  # before MLX: the engine as a worker runs it
    from shared.config import EngineOptions
    from worker.backends.mlx_lm import load, make_backend
    from worker.engine.core import EngineCore
    from worker.steptrace import StepTrace

    model, tokenizer = load(args.model)
    for name in args.settings:
        options = EngineOptions(max_running=8, prefill_batch_size=8, **SETTINGS[name])
        engine = StepTrace.wrap(EngineCore(make_backend(model, tokenizer, options), options))
        for trace in range(args.traces):
            turns = run_trace(engine, name, trace, args)
            line = {"setting": name, "trace": trace, "prompt": turns["prompt"], "ms": turns["ms"]}
            line |= {"cudnn_sdpa": mlx_env[CUDNN_SDPA], "cached": turns["cached"]}
            if args.idle_ms:
                line |= {"idle_ms": args.idle_ms, "idle_spin": args.idle_spin}
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
