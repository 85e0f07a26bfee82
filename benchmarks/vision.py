"""Vision requests per second: mlx-vlm in-process, the project's engine in-process and a
gateway, on the same Qwen2-VL and the same kind of requests.

    python -m benchmarks.vision --shape medium --concurrency 1,8 --requests 16 --repeats 5

The model: MODEL (a Qwen2-VL folder), or one with random weights built for the run from
`--shape` (worker/vision/modelgen.py; tiny: the tests' size; small, medium, large: big
enough that the model's compute dominates a request). Each request: a random-pixel PNG of
`--image` x `--image` pixels and a short numbered question, both never sent before (the
chat template's system prompt is all the prompts share), greedy, `--max-tokens` tokens.
For each concurrency c:
- `mlx-vlm`: mlx-vlm in this process; c = 1: `mlx_vlm.generate`, one request after
  another; c > 1: `mlx_vlm.batch_generate` on groups of c requests, one group after another
  (the images have one shape, so a group is one batch);
- `engine`: the worker's EngineCore in this process (worker/vision/open.py: the vision
  backend and preprocessor), c requests in flight: a new one as soon as one finishes;
- `gateway`: a gateway launched here serving the model (or `--gateway URL` serving it as
  `--served`), c client threads of the official openai SDK, each sending a chat request
  with the image as a data URL as soon as its previous answer is back.
Each source runs `--requests` requests per repeat, once the machine is idle (`--wait-idle`);
a run during which other processes used more than `--max-other` is run again (`--retries`).
The repeats alternate the sources' order. The engine and the gateway ignore EOS; mlx-vlm
cannot be told to, so the tokens each source produced are counted (`usage`; mlx-vlm's own
counts) and reported beside requests/s. Prints a JSON line of machine facts, one per repeat
and a median line per concurrency: requests/s, tokens/s, each source's ratio to mlx-vlm (the
median of the per-repeat ratios) and the CPU other processes used meanwhile. Re-executes
itself under the BLAS preload a worker gets.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import _cpu, _launch, _stats
from shared.protocol import Add
from shared.types import CanonicalRequest, ImagePart, Message, RequestKind, SamplingParams, TextPart
from worker.vision.modelgen import TinyVisionSpec

SOURCES = ("mlx-vlm", "engine", "gateway")
BASELINE = "mlx-vlm"
QUESTION = "What is in this picture?"
SERVED = "vision"


def _shape(hidden: int, layers: int, intermediate: int, vision: int) -> TinyVisionSpec:
    """Qwen2-VL-like proportions: heads of 64, 4 KV heads, a vision tower of 4 blocks; up to
    448 x 448 pixels (256 image tokens) an image."""
    return TinyVisionSpec(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=4,
        intermediate_size=intermediate,
        vocab_size=2048,
        vision_embed_dim=vision,
        vision_depth=4,
        vision_heads=vision // 64,
        max_pixels=448 * 448,
    )


SHAPES = {  # tiny: the tests' model
    "tiny": TinyVisionSpec(),
    "small": _shape(512, 4, 1536, 256),
    "medium": _shape(768, 6, 2048, 384),
    "large": _shape(1024, 8, 2816, 512),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.vision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="a Qwen2-VL folder (default: build --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="medium")
    p.add_argument("--seed", type=int, default=0, help="of the built model's weights")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="per source, repeat and level")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--image", type=int, default=224, help="side of the square images, pixels")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--gateway", help="base URL of a running gateway (default: launch one)")
    p.add_argument("--served", default=SERVED, help="the model's name on --gateway")
    p.add_argument(
        "--prefix-cache",
        choices=("on", "off"),
        default="on",
        help="the engine's and the launched gateway's (on: their default)",
    )
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--wait-idle", type=float, default=60.0, help="at most, s, before each run")
    p.add_argument("--idle-threshold", type=float, default=30.0, help="%% of one core")
    p.add_argument("--max-other", type=float, default=25.0, help="%% of one core: see --retries")
    p.add_argument("--retries", type=int, default=2, help="of a run past --max-other")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        p.error("--concurrency: comma-separated integers")
    args.sources = [s for s in args.sources.split(",") if s]
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency must be positive")
    if min(args.requests, args.repeats, args.max_tokens, args.image, args.retries + 1) < 1:
        p.error("--requests, --repeats, --max-tokens and --image must be positive")
    if not args.sources or not set(args.sources) <= set(SOURCES):
        p.error(f"--sources: some of {', '.join(SOURCES)}")
    return args


# --- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """One request: a question and a PNG."""

    question: str
    png: bytes


class Workload:
    """Requests never seen before: each its own random-pixel image (no prefix cache reuses
    an image's KV) and its number in its question, so that of the prompt only the chat
    template's system prompt is common to all."""

    def __init__(self, side: int) -> None:
        self.side = side
        self.made = 0

    def take(self, count: int) -> list[Ask]:
        import numpy as np
        from PIL import Image

        asks = []
        for _ in range(count):
            rng = np.random.default_rng(self.made)
            pixels = rng.integers(0, 256, (self.side, self.side, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            asks.append(Ask(f"Picture {self.made}: {QUESTION}", buffer.getvalue()))
            self.made += 1
        return asks


# --- the sources -------------------------------------------------------------------------------
# Each runs the requests, `concurrency` at a time, and returns the tokens they produced.


class MlxVlm:
    def __init__(self, path: Path) -> None:
        import mlx_vlm

        loaded: tuple[Any, Any] = mlx_vlm.load(str(path))
        self.model, self.processor = loaded

    def run(self, asks: list[Ask], concurrency: int, max_tokens: int) -> int:
        import mlx_vlm
        from mlx_vlm.prompt_utils import apply_chat_template
        from PIL import Image

        tokens = 0
        for start in range(0, len(asks), concurrency):
            group = asks[start : start + concurrency]
            images: Any = [Image.open(io.BytesIO(a.png)).convert("RGB") for a in group]
            if concurrency == 1:
                config = self.model.config
                prompt: Any = apply_chat_template(
                    self.processor, config, group[0].question, num_images=1
                )
                result = mlx_vlm.generate(
                    self.model,
                    self.processor,
                    prompt,
                    image=images,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    verbose=False,
                )
                tokens += result.generation_tokens
            else:  # greedy: its batch generator's default sampler is argmax
                batch = mlx_vlm.batch_generate(
                    self.model,
                    self.processor,
                    images=images,
                    prompts=[a.question for a in group],
                    max_tokens=max_tokens,
                )
                tokens += batch.stats.generation_tokens
        return tokens


class Engine:
    def __init__(self, path: Path, prefix_cache: bool) -> None:
        from shared.config import EngineOptions, ModelConfig
        from worker.backends.formats import model_formats
        from worker.engine.core import EngineCore
        from worker.vision.open import open_vision, vision_backend, vision_preprocessor

        options = EngineOptions(prefix_cache=prefix_cache)
        config = ModelConfig(name=SERVED, source=str(path), engine=options)
        loaded, processor = open_vision(config, path, lambda *_: None)
        formats = model_formats(loaded.tokenizer, None)
        self.preprocess = vision_preprocessor(loaded, processor, config, formats)
        self.engine = EngineCore(vision_backend(loaded, processor, config), config.engine)
        self.image_token = loaded.model.image_token
        self.ids = 0

    def prepare(self, ask: Ask, max_tokens: int) -> Any:
        parts: list[Any] = [TextPart(ask.question), ImagePart(ask.png, media_type="image/png")]
        request = CanonicalRequest(messages=[Message("user", ask.question, parts=parts)])
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.ids += 1
        return self.preprocess(Add(f"r{self.ids}", RequestKind.CHAT, request, sampling))

    def run(self, asks: list[Ask], concurrency: int, max_tokens: int) -> int:
        waiting = iter(asks)
        tokens = 0

        def admit() -> None:
            ask = next(waiting, None)
            if ask is not None and self.engine.add(self.prepare(ask, max_tokens)) is not None:
                raise RuntimeError("the engine answered a request without running it")

        for _ in range(concurrency):
            admit()
        while self.engine.has_work:
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"engine: {out.error}")
                if out.finish_reason is not None:
                    tokens += out.usage.completion_tokens if out.usage else 0
                    admit()
            self.engine.settle()  # as a worker does once a step's outputs are out
        return tokens


class Gateway:
    def __init__(self, url: str, served: str) -> None:
        self.url, self.served = url, served

    def run(self, asks: list[Ask], concurrency: int, max_tokens: int) -> int:
        import openai

        waiting = iter(asks)
        lock = threading.Lock()
        counts = [0] * concurrency
        errors: list[BaseException] = []

        def client(c: int) -> None:
            api = openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=600)
            while not errors:
                with lock:
                    ask = next(waiting, None)
                if ask is None:
                    return
                url = "data:image/png;base64," + base64.b64encode(ask.png).decode()
                content: Any = [
                    {"type": "text", "text": ask.question},
                    {"type": "image_url", "image_url": {"url": url}},
                ]
                try:
                    answer = api.chat.completions.create(
                        model=self.served,
                        messages=[{"role": "user", "content": content}],
                        max_tokens=max_tokens,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                    )
                except Exception as exc:
                    errors.append(exc)
                    return
                counts[c] += answer.usage.completion_tokens if answer.usage else 0

        threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"gateway: {errors[0]!r}")
        return sum(counts)


@contextlib.contextmanager
def launched_gateway(model: Path, prefix_cache: bool, timeout: float) -> Iterator[_launch.Server]:
    """A gateway serving `model` as SERVED, from a config of its defaults."""
    run_dir = _launch.gateway_run_dir()
    engine: dict[str, Any] = {} if prefix_cache else {"prefix_cache": False}
    config = run_dir / "gw.toml"
    _launch.write_gateway_config(config, run_dir, str(model), SERVED, engine)
    fields = {"python": sys.executable, "config": str(config)}
    env = _launch.without_as_worker()
    server = _launch.Server("gateway", _launch.GATEWAY_COMMAND, fields, env, run_dir)
    try:
        server.wait_ready(timeout)
        _launch.wait_models_ready(server.url, timeout)
        yield server
    except RuntimeError:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


# --- measuring ---------------------------------------------------------------------------------

Run = Callable[[list[Ask], int, int], int]


def measure(
    run: Run, asks: list[Ask], concurrency: int, max_tokens: int, server_cpu: Callable[[], Any]
) -> dict[str, Any]:
    """The requests' rates, and the CPU that processes other than this one and a launched
    gateway used meanwhile (% of one core): near 0 on a quiet machine."""
    before, own, server = _cpu.snapshot(), time.process_time(), server_cpu()
    start = time.perf_counter()
    tokens = run(asks, concurrency, max_tokens)
    seconds = time.perf_counter() - start
    after, own, server = _cpu.snapshot(), time.process_time() - own, _delta(server_cpu(), server)
    busy = _cpu.busy_pct(before, after)
    other = None if busy is None else round(busy - 100 * (own + server) / seconds, 1)
    return {
        "req_s": round(len(asks) / seconds, 3),
        "tok_s": round(tokens / seconds, 2),
        "tokens_per_request": round(tokens / len(asks), 2),
        "seconds": round(seconds, 2),
        "other_cpu_pct": other,
        "steal_pct": _cpu.steal_pct(before, after),
    }


def _delta(after: float | None, before: float | None) -> float:
    return after - before if after is not None and before is not None else 0.0


def median_line(concurrency: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    line: dict[str, Any] = {"concurrency": concurrency, "median": True}
    for source, results in runs.items():
        line[source] = {
            key: round(statistics.median(r[key] for r in results), 3)
            for key in ("req_s", "tok_s", "tokens_per_request")
        }
        others = [r["other_cpu_pct"] for r in results if r["other_cpu_pct"] is not None]
        line[source]["other_cpu_pct"] = round(statistics.median(others), 1) if others else None
        if source != BASELINE and BASELINE in runs:
            pairs = list(zip(results, runs[BASELINE], strict=True))
            line[f"{source}/{BASELINE}"] = {
                key: round(statistics.median(r[key] / b[key] for r, b in pairs), 3)
                for key in ("req_s", "tok_s")
            }
    return line


def facts(path: Path, engine: Engine | None, args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from worker.modelgen import count_parameters

    machine = _stats.machine_info(os.environ.get("LD_PRELOAD"))
    machine.update(mlx_device=str(mx.default_device()), mlx_vlm=metadata.version("mlx-vlm"))
    model: dict[str, Any] = {"path": str(path), "parameters": count_parameters(path)}
    if not args.model:
        model.update(shape=args.shape, seed=args.seed)
    if engine is not None:
        prompt = engine.prepare(Workload(args.image).take(1)[0], 1).prompt
        model.update(prompt_tokens=len(prompt), image_tokens=prompt.count(engine.image_token))
    keys = ("concurrency", "requests", "repeats", "max_tokens", "image", "sources", "prefix_cache")
    return {"machine": machine, "model": model, "args": {k: getattr(args, k) for k in keys}}


def _quiet_transformers() -> None:
    """mlx-vlm's batch_generate makes transformers warn once an image about its kwargs."""
    with contextlib.suppress(ImportError, AttributeError):
        from transformers.utils import logging

        logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _launch.as_worker("benchmarks.vision", argv)
    _quiet_transformers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch
    with contextlib.ExitStack() as stack:
        if args.model:
            path = Path(args.model)
        else:
            from worker.vision.modelgen import build_tiny_vision_model

            built = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vision-"))
            path = build_tiny_vision_model(built, args.seed, spec=SHAPES[args.shape])
        cache = args.prefix_cache == "on"
        engine = Engine(path, cache) if "engine" in args.sources else None
        runs: dict[str, Run] = {}
        if "mlx-vlm" in args.sources:
            runs["mlx-vlm"] = MlxVlm(path).run
        if engine is not None:
            runs["engine"] = engine.run
        server_cpu: Callable[[], float | None] = lambda: None  # noqa: E731
        if "gateway" in args.sources and args.gateway:
            runs["gateway"] = Gateway(args.gateway, args.served).run
        elif "gateway" in args.sources:
            server = stack.enter_context(launched_gateway(path, cache, args.ready_timeout))
            runs["gateway"], server_cpu = Gateway(server.url, SERVED).run, server.cpu_seconds
        print(json.dumps(facts(path, engine, args)), flush=True)
        measure_all(args, runs, server_cpu)
    return 0


def measure_all(
    args: argparse.Namespace, runs: dict[str, Run], server_cpu: Callable[[], float | None]
) -> None:
    workload = Workload(args.image)
    for concurrency in args.concurrency:
        for run in runs.values():  # warm: first use of each shape, the batch's buffers
            run(workload.take(concurrency), concurrency, min(args.max_tokens, 8))
        results: dict[str, list[dict[str, Any]]] = {source: [] for source in runs}
        for repeat in range(args.repeats):
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            line: dict[str, Any] = {"concurrency": concurrency, "repeat": repeat}
            for source in order:
                result = measured(args, runs[source], workload, concurrency, server_cpu, source)
                results[source].append(result)
                line[source] = result
            print(json.dumps(line), flush=True)
        print(json.dumps(median_line(concurrency, results)), flush=True)


def measured(
    args: argparse.Namespace,
    run: Run,
    workload: Workload,
    concurrency: int,
    server_cpu: Callable[[], float | None],
    label: str,
) -> dict[str, Any]:
    """One run after the machine went idle; one during which other processes used more
    than --max-other is run again with new requests, up to --retries times: the run that
    saw the least of them stands, `contended` when even it saw too much."""
    tried = []
    for _ in range(args.retries + 1):
        waited = _cpu.wait_idle(args.wait_idle, args.idle_threshold, label)
        asks = workload.take(args.requests)
        result = measure(run, asks, concurrency, args.max_tokens, server_cpu)
        tried.append({**result, "idle_wait_s": waited["idle_wait_s"]})
        if (result["other_cpu_pct"] or 0.0) <= args.max_other:
            break
    best = min(tried, key=lambda r: r["other_cpu_pct"] or 0.0)
    contended = (best["other_cpu_pct"] or 0.0) > args.max_other
    return {**best, "runs": len(tried), "contended": contended}


if __name__ == "__main__":
    # a SIGTERM unwinds main, which stops the gateway it launched
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
