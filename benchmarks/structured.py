"""What structured output costs a decode step, in one process: the engine with its rows
batch, llguidance's masks, no gateway.

    python -m benchmarks.structured MODEL --rows 1,32 --steps 150 --repeats 2

For each batch size, `rows` sequences with the same 128-token prompt decode together, and
the median time between steps that returned tokens is taken (the first WARM_STEPS left
out), in four mixes:
- `plain`: no row constrained (the baseline, in the same run);
- `json`: every row constrained to a JSON schema (an array of objects with a string, an
  integer and a boolean; long enough that no row completes it within the run);
- `one-json`: one row constrained, the rest plain: what the others pay for a neighbour's
  grammar (its mask needs the previous token, so the step waits for it; the forward pass
  is queued first);
- `half-json`: half the rows constrained.
Every step returns one token per row, so a step's time is the time per token of each row.
Each repeat is a round of every mix (in reverse order every other round, so that a machine
drifting during a run favours none). Prints one JSON line per (rows, round): each mix's
median step in ms and its ratio to that round's plain; then, per size, a line with
"median": the median over the rounds of each mix's step and of each ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.engine_steps import WARM_STEPS, _positive_list

PROMPT = list(range(5, 133))  # 128 tokens, inside every generated vocabulary
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 10000,  # never complete within a run: every row decodes every step
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "count": {"type": "integer", "minimum": 0, "maximum": 100000},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "count", "ok"],
        "additionalProperties": False,
    },
}
MIXES = ("plain", "json", "one-json", "half-json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument("--rows", type=_positive_list, default=[1, 32])
    p.add_argument("--steps", type=int, default=150, help="steps timed per mix and size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batcher", choices=("rows", "mlx_lm"), default="rows")
    p.add_argument(
        "--mixes",
        type=lambda text: [m for m in text.split(",") if m],
        default=list(MIXES),
        help=f"comma-separated, of {','.join(MIXES)} (plain is always run)",
    )

    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    unknown = [m for m in args.mixes if m not in MIXES]
    if unknown:
        p.error(f"unknown mix {unknown[0]!r}: one of {', '.join(MIXES)}")
    args.mixes = ["plain", *[m for m in MIXES if m in args.mixes and m != "plain"]]
    return args


def _applies(mix: str, rows: int) -> bool:
    """Whether a mix differs from the others at this size (one-json at 1 row is json)."""
    guided = constrained(mix, rows)
    return mix == "plain" or (guided > 0 and (mix == "json" or guided < rows))


def constrained(mix: str, rows: int) -> int:
    return {"plain": 0, "json": rows, "one-json": 1, "half-json": rows // 2}[mix]


def run_mix(
    model: Any,
    tokenizer: Any,
    preprocess: Any,
    batcher: str,
    rows: int,
    guided: int,
    steps: int,
) -> float:
    """The median step (ms) of `rows` rows of which `guided` are constrained."""
    from shared.config import EngineOptions
    from shared.protocol import Add
    from shared.types import (
        CanonicalRequest,
        OutputFormat,
        RequestKind,
        ResponseFormat,
        SamplingParams,
    )
    from worker.backends.mlx_lm import make_backend
    from worker.engine.core import EngineCore

    options = EngineOptions(
        max_running=max(rows, 1),
        prefill_batch_size=max(rows, 1),
        batcher=batcher,  # type: ignore[arg-type]
        prefix_cache=False,
    )
    core = EngineCore(make_backend(model, tokenizer, options), options)
    budget = steps + WARM_STEPS + 8
    sampling = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA)
    for i in range(rows):
        request = CanonicalRequest(
            prompt_token_ids=PROMPT, response_format=fmt if i < guided else None
        )
        core.add(preprocess(Add(f"r{i}", RequestKind.COMPLETION, request, sampling)))
    times: list[float] = []
    last = time.perf_counter()
    try:
        for _ in range(100 * (steps + WARM_STEPS)):
            if len(times) >= steps + WARM_STEPS:
                break
            outputs = core.step()
            core.settle()  # as a worker does once a step's outputs are out
            if sum(len(o.token_ids) for o in outputs) == rows:  # every row made a token
                now = time.perf_counter()
                times.append(now - last)
                last = now
            elif outputs:
                last = time.perf_counter()
        if len(times) <= WARM_STEPS:
            raise RuntimeError("the batch stopped producing tokens")
        return 1000 * statistics.median(times[WARM_STEPS:])
    finally:
        core.abort(core.request_ids())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import mlx.core as mx

    from shared.config import EngineOptions
    from worker.backends.mlx_lm import load
    from worker.preprocess import Preprocessor

    model, tokenizer = load(args.model)
    preprocess = Preprocessor(tokenizer, EngineOptions(), max_context=1 << 20)
    started = time.perf_counter()
    preprocess.grammars.matcher(_grammar())  # the tokenizer map and the schema, once
    setup_ms = 1000 * (time.perf_counter() - started)
    for rows in args.rows:
        mixes = [m for m in args.mixes if _applies(m, rows)]
        ratios: dict[str, list[float]] = {m: [] for m in mixes if m != "plain"}
        steps: dict[str, list[float]] = {m: [] for m in mixes}
        for repeat in range(args.repeats):
            line: dict[str, Any] = {"rows": rows, "repeat": repeat, "setup_ms": setup_ms}
            # every other round runs the mixes in reverse: a machine drifting during a
            # round then favours no mix
            for mix in mixes if repeat % 2 == 0 else mixes[::-1]:
                line[mix] = run_mix(
                    model,
                    tokenizer,
                    preprocess,
                    args.batcher,
                    rows,
                    constrained(mix, rows),
                    args.steps,
                )
                steps[mix].append(line[mix])
                mx.clear_cache()
            for mix in ratios:
                line[f"{mix}/plain"] = line[mix] / line["plain"]
                ratios[mix].append(line[f"{mix}/plain"])
            print(json.dumps({k: _round(v) for k, v in line.items()}), flush=True)
        summary: dict[str, Any] = {"rows": rows, "rounds": args.repeats, "median": True}
        summary.update({mix: statistics.median(v) for mix, v in steps.items()})
        summary.update({f"{mix}/plain": statistics.median(v) for mix, v in ratios.items()})
        print(json.dumps({k: _round(v) for k, v in summary.items()}), flush=True)
    return 0


def _grammar() -> str:
    from worker.structured.grammars import json_grammar

    return json_grammar(SCHEMA, "response_format", strict=True)


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    raise SystemExit(main())
