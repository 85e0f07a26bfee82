"""Where a request's first token comes from, in one process: the engine with
`engine.first_token = "prefill"` (the output head over the prompt's last position in its own
prefill, worker/backends/groups.py) against "step" (mlx-lm's way: the prompt's last token
fed to the batch's next decode step).

    python -m benchmarks.first_token MODEL --cases 0x128,8x128,32x128,32x128x8,0x2048

Each case is RUNNINGxPROMPT[xJOINERS]: both engines decode RUNNING rows of 128-token prompts
(greedy, no end), then, trial after trial, alternating which engine goes first, JOINERS
requests (default 1) of PROMPT, PROMPT - 1, ... tokens are added together and the time from
`add` to each one's first token taken (their mean is the trial's). Prints one JSON line per
case: each setting's quartiles in ms over the trials after WARM_TRIALS, and the median time
of a step of the running batch between trials (`<setting>_step_ms`). MLX runs as a worker
runs it (under CUDA, off cuDNN's attention; on a CPU, OpenBLAS preloaded: it re-executes
itself under a worker's environment, benchmarks/_launch.py `as_worker`) unless the
environment says otherwise (`MLX_CUDA_USE_CUDNN_SDPA=1`; each line says which,
`cudnn_sdpa`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks import _launch
from shared.blas import CUDNN_SDPA, mlx_worker_defaults

WARM_TRIALS = 3
SETTINGS = ("prefill", "step")


def parse_case(text: str) -> tuple[int, int, int]:
    """argparse's type for RUNNINGxPROMPT[xJOINERS]."""
    try:
        values = [int(v) for v in text.lower().split("x")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not RUNNINGxPROMPT[xJOINERS]: {text!r}") from exc
    if len(values) == 2:
        values.append(1)
    running, prompt, joiners = values if len(values) == 3 else (-1, 0, 0)
    if running < 0 or joiners < 1 or prompt < joiners + 1:
        raise argparse.ArgumentTypeError(f"not RUNNINGxPROMPT[xJOINERS]: {text!r}")
    return running, prompt, joiners


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_token", description=__doc__)
    p.add_argument("model", help="an mlx-lm model directory")
    p.add_argument(
        "--cases",
        type=lambda s: [parse_case(c) for c in s.split(",") if c.strip()],
        default=[parse_case(c) for c in ("0x128", "8x128", "32x128", "32x128x8", "0x2048")],
        help="comma-separated RUNNINGxPROMPT[xJOINERS]",
    )
    p.add_argument("--trials", type=int, default=20, help="timed trials a case and setting")
    args = p.parse_args(argv)
    if args.trials < 2:
        p.error("--trials must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _launch.as_worker("benchmarks.first_token", argv)
    mlx_env = mlx_worker_defaults(os.environ)  # before MLX: the engine as a worker runs it
    from shared.config import EngineOptions
    from shared.types import SamplingParams
    from worker.backends.mlx_lm import load, make_backend
    from worker.engine.core import EngineCore
    from worker.preprocess import PreparedRequest

    model, tokenizer = load(args.model)
    vocab = max(16, min(400, getattr(tokenizer, "vocab_size", 400) - 8))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    made = [0]

    def prompt(length: int) -> list[int]:  # a new one each time: no prefix is shared
        made[0] += 1
        return [(7 * made[0] + 13 * i) % vocab + 5 for i in range(length)]

    for running, length, joiners in args.cases:
        engines: dict[str, Any] = {}
        for setting in SETTINGS:
            options = EngineOptions(
                max_running=max(8, running + joiners),
                prefill_batch_size=max(8, running + joiners),
                batcher="rows",
                prefix_cache=False,
                first_token=setting,  # type: ignore[arg-type]
            )
            engines[setting] = EngineCore(make_backend(model, tokenizer, options), options)
            for i in range(running):
                engines[setting].add(PreparedRequest(f"run{i}", prompt(128), 10**6, greedy))
            for _ in range(20):
                engines[setting].step()
                engines[setting].settle()
        times: dict[str, list[float]] = {s: [] for s in SETTINGS}
        steps: dict[str, list[float]] = {s: [] for s in SETTINGS}
        for trial in range(WARM_TRIALS + args.trials):
            for setting in SETTINGS if trial % 2 == 0 else SETTINGS[::-1]:
                engine = engines[setting]
                started = time.perf_counter()
                for _ in range(3):
                    engine.step()
                    engine.settle()  # as a worker does once a step's outputs are out
                step_ms = 1000 * (time.perf_counter() - started) / 3
                ids = [f"t{trial}-{j}" for j in range(joiners)]
                started = time.perf_counter()
                for j, request_id in enumerate(ids):
                    engine.add(PreparedRequest(request_id, prompt(length - j), 64, greedy))
                left, firsts = set(ids), []
                for _ in range(10_000):  # bounded: a first token takes a few steps at most
                    if not left:
                        break
                    for out in engine.step():
                        if out.request_id in left and out.token_ids:
                            left.discard(out.request_id)
                            firsts.append(1000 * (time.perf_counter() - started))
                    engine.settle()
                if left:
                    raise RuntimeError(f"no first token for {sorted(left)}")
                engine.abort(ids)
                if trial >= WARM_TRIALS:
                    times[setting].append(statistics.mean(firsts))
                    steps[setting].append(step_ms)
        for engine in engines.values():
            engine.abort(engine.request_ids())
        line: dict[str, Any] = {"running": running, "prompt": length, "joiners": joiners}
        line["cudnn_sdpa"] = mlx_env[CUDNN_SDPA]
        for setting in SETTINGS:
            line[setting] = [round(q, 2) for q in statistics.quantiles(times[setting], n=4)]
            line[f"{setting}_step_ms"] = round(statistics.median(steps[setting]), 2)
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
