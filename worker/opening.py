"""A model's worker parts by its kind: its engine, the preprocessor the input thread runs,
the requests that probe it before Ready, and its Ready. The worker process (proc.py) owns
sockets and threads; what a kind needs to serve lives here and in the kind's package.

Every kind's engine has the same surface (`Engine`): the worker adds prepared requests,
steps it while it has work and sends what each step returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

from shared.config import EngineOptions, ModelConfig, ModelKind
from shared.modelinfo import served_by
from shared.protocol import Add, Capacity, PrefixCacheStats, Ready
from shared.types import RequestOutput
from worker.backends.formats import ModelFormats, model_formats
from worker.backends.mlx_lm import make_backend
from worker.embeddings.open import only_for_embeddings, open_encoder
from worker.engine.core import EngineCore
from worker.faults import Faults, FaultyEngine
from worker.loader import LoadedModel, Progress, load_model
from worker.memory import device_memory, kv_budget
from worker.preprocess import Preprocessor, capabilities
from worker.steptrace import StepTrace

log = logging.getLogger("worker")


class Engine(Protocol):
    """What the worker process drives, whatever the model's kind."""

    backend: Any  # release_memory() when idle; device
    steps: int  # steps taken (heartbeats report it)

    @property
    def has_work(self) -> bool: ...

    @property
    def can_step(self) -> bool:
        """A step would do something now (else the worker waits for inputs)."""
        ...

    def add(self, prepared: Any) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def settle(self) -> None:
        """What the last step put off until its outputs were sent (EngineCore: its finished
        rows' leaving and the prefix cache's stores); the next step does it first."""
        ...

    def abort(self, request_ids: list[str]) -> list[RequestOutput]: ...

    def request_ids(self) -> list[str]: ...

    def counts(self) -> tuple[int, int]: ...

    def prefix_stats(self) -> PrefixCacheStats | None: ...

    def probe(self, *args: Any, **kwargs: Any) -> None:
        """One real request through, or raise: Ready means ready (a prepared request of its
        own may be given as `prepared`)."""
        ...


@dataclass(slots=True)
class Opened:
    engine: Any  # an Engine (EngineCore for text and vision models)
    preprocess: Callable[[Add], Any]  # on the input thread: a frame into a prepared request
    ready: Ready
    # prepared requests to probe with after the engine's own probe (an image's, say)
    probes: list[Any] = field(default_factory=list)


def open_model(
    config: ModelConfig, path: Path, kind: ModelKind, worker_id: str, faults: Faults,
    progress: Progress, group: Any = None,
) -> Opened:  # fmt: skip
    if kind in (ModelKind.EMBEDDING, ModelKind.RERANK):
        return _embeddings(config, path, kind, worker_id, faults, progress)
    only_for_embeddings(config, kind)
    if kind is ModelKind.VISION:
        return _vision(config, path, worker_id, faults, progress)
    if kind in (ModelKind.TRANSCRIPTION, ModelKind.SPEECH):
        return _speech(config, path, kind, worker_id, faults, progress)
    return _text(config, path, worker_id, faults, progress, group)


def text_preprocessor(
    loaded: LoadedModel, opts: EngineOptions, formats: ModelFormats, group: Any = None
) -> Preprocessor:
    """A text model's preprocessor: off the request's path what can be (a grammar's compile,
    a segment check) on a worker of its own; on it in a sharded group, whose ranks prepare
    requests on their engine threads and must decide alike."""
    preprocess = Preprocessor(loaded.tokenizer, opts, loaded.max_context, formats)
    preprocess.off_path = group is None
    return preprocess


def _text(
    config: ModelConfig,
    path: Path,
    worker_id: str,
    faults: Faults,
    progress: Progress,
    group: Any = None,
) -> Opened:
    loaded = load_model(config, progress, path, group)
    engine = text_engine(config, loaded, faults)
    opts = config.engine
    formats = model_formats(loaded.tokenizer, opts.tool_parser)
    preprocess = text_preprocessor(loaded, opts, formats, group)
    served = capabilities(loaded.tokenizer, formats)
    return Opened(engine, preprocess, text_ready(config, loaded, engine, worker_id, served))


def _vision(
    config: ModelConfig, path: Path, worker_id: str, faults: Faults, progress: Progress
) -> Opened:
    from worker.vision.open import open_vision, probe_request, vision_backend, vision_preprocessor

    loaded, processor = open_vision(config, path, progress)
    engine = text_engine(config, loaded, faults, vision_backend(loaded, processor, config))
    formats = model_formats(loaded.tokenizer, config.engine.tool_parser)
    preprocess = vision_preprocessor(loaded, processor, config, formats)
    served = [*capabilities(loaded.tokenizer, formats), "vision"]
    ready = text_ready(config, loaded, engine, worker_id, served)
    ready.versions["mlx_vlm"] = version("mlx-vlm")
    return Opened(engine, preprocess, ready, [probe_request(preprocess)])


def _embeddings(
    config: ModelConfig, path: Path, kind: ModelKind, worker_id: str, faults: Faults,
    progress: Progress,
) -> Opened:  # fmt: skip
    progress("loading weights", -1.0)
    engine, preprocess = open_encoder(config, path, kind)
    opts = config.engine
    ready = Ready(
        worker_id,
        Capacity(opts.max_running, opts.max_waiting, engine.encoder.max_tokens),
        versions={"mlx": version("mlx")},
        capabilities=served_by(config, kind) or [],
        device=engine.backend.device,
        device_memory_bytes=device_memory(),
    )
    return Opened(FaultyEngine.wrap(engine, faults), preprocess, ready)  # type: ignore[arg-type]


def _speech(
    config: ModelConfig, path: Path, kind: ModelKind, worker_id: str, faults: Faults,
    progress: Progress,
) -> Opened:  # fmt: skip
    """Speech to text (Whisper: one request at a time) or text to speech (requests made
    chunk by chunk, side by side), through mlx-audio."""
    progress("loading weights", -1.0)
    engine: Any
    preprocess: Any
    if kind is ModelKind.TRANSCRIPTION:
        from worker.speech.transcribe import open_transcriber

        engine, preprocess, served = open_transcriber(config, path)
    else:
        from worker.speech.synthesize import open_synthesizer

        engine, preprocess, served = open_synthesizer(config, path)
    opts = config.engine
    running = 1 if kind is ModelKind.TRANSCRIPTION else opts.max_running
    ready = Ready(
        worker_id,
        Capacity(running, opts.max_waiting, 0),  # no token context: audio has its own limits
        versions={"mlx": version("mlx"), "mlx_audio": version("mlx-audio")},
        capabilities=served + (["demo"] if config.is_demo else []),
        device=engine.backend.device,
        device_memory_bytes=device_memory(),
    )
    return Opened(FaultyEngine.wrap(engine, faults), preprocess, ready)


def text_engine(
    config: ModelConfig, loaded: LoadedModel, faults: Faults, backend: Any = None
) -> EngineCore:
    opts = config.engine
    backend = backend or make_backend(loaded.model, loaded.tokenizer, opts)
    log.info("continuous batch: %s (engine.batcher = %r)", backend.batcher, opts.batcher)
    budget = kv_budget(opts)
    engine = EngineCore(backend, opts, budget)
    if budget is not None:
        log.info(
            "KV budget %.1f GiB (%d bytes a token)",
            budget / 2**30,
            engine.scheduler.config.kv_bytes_per_token,
        )
    return StepTrace.wrap(FaultyEngine.wrap(engine, faults))


def text_ready(
    config: ModelConfig, loaded: LoadedModel, engine: EngineCore, worker_id: str,
    served: list[str],
) -> Ready:  # fmt: skip
    opts = config.engine
    cache = engine.prefix_cache
    return Ready(
        worker_id,
        Capacity(opts.max_running, opts.max_waiting, loaded.max_context),
        versions={"mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
        capabilities=served + (["demo"] if loaded.is_demo else []),
        device=engine.backend.device,
        device_memory_bytes=device_memory(),
        prefix_cache_bytes=cache.capacity if cache is not None else 0,
    )
