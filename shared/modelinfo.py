"""What a model directory says about itself without loading it: context length and the
capabilities that follow from its files. The worker reports the same facts in Ready once
loaded; the gateway (which never imports MLX) reads them here for models not loaded yet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.config import ModelConfig

DEFAULT_CONTEXT = 4096
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


def text_capabilities(chat_template: bool) -> list[str]:
    """What a text model served by mlx-lm can do: chat needs a chat template; structured
    output is llguidance's (tools and reasoning depend on the template: the worker says)."""
    chat = ["chat"] if chat_template else []
    return [*chat, "completion", "logprobs", "echo", "tokenize", "structured_output"]


def context_length(path: Path, config: ModelConfig) -> int:
    """engine.max_context, else the model config's position limit, else DEFAULT_CONTEXT."""
    if config.engine.max_context:
        return config.engine.max_context
    model_config = _json(path / "config.json") or {}
    for key in _CONTEXT_KEYS:
        value = model_config.get(key) or (model_config.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def has_chat_template_files(path: Path) -> bool:
    """A chat template in tokenizer_config.json or in its own file (as transformers reads)."""
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    return bool((_json(path / "tokenizer_config.json") or {}).get("chat_template"))


def peek(config: ModelConfig) -> tuple[int | None, list[str] | None]:
    """(context length, capabilities) of a local model directory; (None, None) for a hub id
    not downloaded yet or a directory that cannot be read."""
    path = Path(config.source).expanduser()
    if not (path / "config.json").is_file():
        return None, None
    try:
        return context_length(path, config), text_capabilities(has_chat_template_files(path))
    except (OSError, ValueError):
        return None, None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None
