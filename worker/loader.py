"""Resolve a model's source (demo, local path or hub id) and load it with mlx-lm."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import ModelConfig

DEFAULT_CONTEXT = 4096
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


def resolve_source(config: ModelConfig) -> Path:
    if config.is_demo:
        from worker.modelgen import ensure_demo_model

        return ensure_demo_model()
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
    return _download(config)


def _download(config: ModelConfig) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(config.source, revision=config.revision, allow_patterns=HUB_PATTERNS)
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


def load_model(config: ModelConfig) -> LoadedModel:
    from mlx_lm import load

    path = resolve_source(config)
    try:
        model, tokenizer = load(str(path), trust_remote_code=config.trust_remote_code)[:2]
    except Exception as exc:
        raise LoadError(f"model {config.name!r}: mlx-lm could not load {path}: {exc}") from exc
    return LoadedModel(model, tokenizer, path, _max_context(path, config), config.is_demo)


def _max_context(path: Path, config: ModelConfig) -> int:
    if config.engine.max_context:
        return config.engine.max_context
    model_config = json.loads((path / "config.json").read_text())
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = model_config.get(key) or model_config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT
