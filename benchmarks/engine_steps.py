"""What the engine's layer costs a decode step, in one process: no gateway, no sockets.

    python -m benchmarks.engine_steps MODEL --rows 1,32,128 --steps 150 --repeats 2

For each batch size, `rows` sequences with the same 128-token prompt decode together
(greedy, no stop; with --ragged, prompts of 113-128 tokens, so that every step needs an
attention mask, as a served batch of requests that arrived at different times does) and
the time between consecutive steps that returned tokens is taken, the first WARM_STEPS
left out, under each driver:
- `batchgenerator`: mlx-lm's BatchGenerator alone (what the serving ceiling runs);
- `engine-mlx_lm`: the worker's EngineCore on BatchGenerator (`engine.batcher = "mlx_lm"`),
  detokenizing, checking stops and encoding each step's deltas as the worker sends them;
- `engine-rows`: the same on the engine's own batch (`engine.batcher = "rows"`) with
  mlx-lm's forward pass (`engine.decode_step = "model"`);
- `engine-compiled`: the rows batch with the project's compiled decode step
  (`engine.decode_step = "compiled"`, worker/backends/decode_step.py), each projection
  multiplied apart (its default);
- `engine-fused`: the same with each layer's Q/K/V and gate/up weights stacked into one
  matrix each (`engine.decode_projections = "stacked"`; the model's layers read slices of
  them);
- `engine-compiled-mask`: `engine-compiled` with MLX's attention and a mask for rows of
  different lengths (`engine.decode_attention = "mlx"`), where `engine-compiled` takes the
  ragged-attention kernel on MLX's CUDA backend (worker/backends/ragged_attention.py;
  elsewhere the two are the same);
- `generate_step` (batch 1 only): mlx-lm's single-stream generation, no batch at all.
Prints one JSON line per (rows, repeat): each driver's median step in ms (null for a compiled
driver whose step could not be built, its probe failed say: it is not timed as the forward
pass under another name), and where NVML
answers (an NVIDIA GPU with `pynvml`), the GPU's busy share over its timed steps
(`<driver>_gpu_busy`, percent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks._nvml import BusyMeter

WARM_STEPS = 20
PROMPT = list(range(5, 133))  # 128 tokens, inside every generated vocabulary
DRIVERS = (
    "batchgenerator",
    "engine-mlx_lm",
    "engine-rows",
    "engine-compiled",
    "engine-fused",
    "engine-compiled-mask",
    "generate_step",
)


def positive_ints(text: str) -> list[int]:
    """argparse's type for a comma-separated list of positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_steps", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--rows", type=positive_ints, default=[1, 32, 128])
    p.add_argument("--steps", type=int, default=150, help="steps timed a driver and size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-running", type=int, default=128, help="the batch's row limit")
    p.add_argument(
        "--ragged",
        action="store_true",
        help="rows of 16 different lengths (a masked step) instead of one",
    )
    p.add_argument(
        "--drivers",
        default=",".join(DRIVERS),
        help=f"comma-separated, of: {', '.join(DRIVERS)}",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    if max(args.rows) > args.max_running:
        p.error("--rows above --max-running")
    args.drivers = [d.strip() for d in args.drivers.split(",") if d.strip()]
    unknown = sorted(set(args.drivers) - set(DRIVERS))
    if unknown or not args.drivers:
        p.error(f"--drivers: unknown {', '.join(unknown) or '(none given)'}")
    return args


def _median_ms(step: Callable[[], bool], steps: int) -> float:
    """Median time between calls of `step` that produced tokens, after WARM_STEPS of them."""
    times: list[float] = []
    last = time.perf_counter()
    for _ in range(100 * (steps + WARM_STEPS)):  # bounded: a step without tokens is rare
        if len(times) >= steps + WARM_STEPS:
            break
        if step():
            now = time.perf_counter()
            times.append(now - last)
            last = now
    if len(times) <= WARM_STEPS:
        raise RuntimeError("the batch stopped producing tokens")
    return 1000 * statistics.median(times[WARM_STEPS:])


def prompts(rows: int, ragged: bool) -> list[list[int]]:
    """The rows' prompts: one length, or (`ragged`) 16 lengths from 113 to 128 tokens."""
    return [PROMPT[: len(PROMPT) - (i % 16 if ragged else 0)] for i in range(rows)]


def batchgenerator(
    model: Any, rows: int, steps: int, max_running: int, ragged: bool = False
) -> float:
    from mlx_lm.generate import BatchGenerator

    budget = steps + WARM_STEPS + 8
    gen = BatchGenerator(
        model,
        max_tokens=budget,
        stop_tokens=None,
        completion_batch_size=max_running,
        prefill_batch_size=max_running,
    )
    gen.insert(prompts(rows, ragged), max_tokens=[budget] * rows)
    try:
        return _median_ms(lambda: bool(gen.next()[1]), steps)
    finally:
        gen.close()


def generate_step(model: Any, steps: int) -> float:
    """mlx-lm's single-stream generation (batch 1), greedy."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    stream = mlx_lm_generate_step(mx_array(PROMPT), model, max_tokens=steps + WARM_STEPS + 8)
    return _median_ms(lambda: next(stream, None) is not None, steps)


def mx_array(tokens: list[int]) -> Any:
    import mlx.core as mx

    return mx.array(tokens)


def engine(
    model: Any,
    tokenizer: Any,
    batcher: str,
    rows: int,
    steps: int,
    max_running: int,
    decode_step: str = "model",
    fuse: bool = False,
    ragged: bool = False,
    kernel: bool = True,
) -> float | None:
    """The engine's median step, or None where the compiled step asked for could not be
    built (its probe failed, say: the step would be the forward pass under another name)."""
    from shared.config import EngineOptions
    from shared.protocol import Codec, StepOutputs
    from shared.types import SamplingParams
    from worker.backends.mlx_lm import make_backend
    from worker.engine.core import EngineCore
    from worker.preprocess import PreparedRequest

    options = EngineOptions(
        max_running=max_running,
        prefill_batch_size=max_running,
        batcher=batcher,  # type: ignore[arg-type]
        decode_step=decode_step,  # type: ignore[arg-type]
        decode_projections="stacked" if fuse else "separate",
        prefix_cache=False,
    )
    backend = make_backend(model, tokenizer, options)
    if not kernel:  # the step without its attention kernel
        from worker.backends.decode_step import build

        backend.batch.decode = build(model, fuse=fuse, ragged=False)  # type: ignore[attr-defined]
    if decode_step == "compiled" and backend.batch.decode is None:  # type: ignore[attr-defined]
        return None
    core = EngineCore(backend, options)
    codec = Codec()
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(rows, ragged)):
        core.add(PreparedRequest(f"r{i}", prompt, steps + WARM_STEPS + 8, sampling))

    def step() -> bool:
        outputs = core.step()
        if outputs:
            codec.encode(StepOutputs("bench", core.steps, outputs))
        core.settle()  # as a worker does once a step's outputs are out
        return any(o.token_ids for o in outputs)

    try:
        return _median_ms(step, steps)
    finally:
        core.abort(core.request_ids())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import mlx.core as mx

    from worker.backends.mlx_lm import load

    model, tokenizer = load(args.model)
    at = (args.steps, args.max_running)
    ragged = args.ragged
    runs: dict[str, Callable[[int], float | None]] = {
        "batchgenerator": lambda rows: batchgenerator(model, rows, *at, ragged),
        "engine-mlx_lm": lambda rows: engine(model, tokenizer, "mlx_lm", rows, *at, ragged=ragged),
        "engine-rows": lambda rows: engine(model, tokenizer, "rows", rows, *at, ragged=ragged),
        "engine-compiled": lambda rows: engine(
            model, tokenizer, "rows", rows, *at, "compiled", False, ragged
        ),
        "engine-fused": lambda rows: engine(
            model, tokenizer, "rows", rows, *at, "compiled", True, ragged
        ),
        "engine-compiled-mask": lambda rows: engine(
            model, tokenizer, "rows", rows, *at, "compiled", False, ragged, kernel=False
        ),
        "generate_step": lambda rows: generate_step(model, args.steps),
    }
    for rows in args.rows:
        for repeat in range(args.repeats):
            line: dict[str, Any] = {"rows": rows, "repeat": repeat}
            if ragged:
                line["ragged"] = True
            for driver in args.drivers:
                if driver == "generate_step" and rows != 1:
                    continue
                with BusyMeter() as busy:
                    line[driver] = runs[driver](rows)
                if busy.share is not None:
                    line[f"{driver}_gpu_busy"] = busy.share
            rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}
            print(json.dumps(rounded), flush=True)
            mx.clear_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
