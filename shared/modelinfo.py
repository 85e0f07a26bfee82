"""What a model directory says about itself without loading it: context length and the
capabilities that follow from its files. The worker reports the same facts in Ready once
loaded; the gateway (which never imports MLX) reads them here for models not loaded yet."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.config import (
    DEMO_SOURCE,
    MINILM_SOURCE,
    STT_DEMO_SOURCE,
    TTS_DEMO_SOURCE,
    VISION_DEMO_SOURCE,
    ModelConfig,
    ModelKind,
)

DEFAULT_CONTEXT = 4096
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


def text_capabilities(chat_template: bool) -> list[str]:
    """What a text model served by mlx-lm can do: chat needs a chat template; structured
    output is llguidance's (tools and reasoning depend on the template: the worker says)."""
    chat = ["chat"] if chat_template else []
    return [*chat, "completion", "logprobs", "echo", "tokenize", "structured_output"]


# model_type values of the encoders the embedding worker runs (worker/embeddings/bert.py)
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
# model_type values that say a folder is a speech model (mlx-audio's): speech to text, and
# text to speech (families whose model_type is a text model's, such as Orpheus's "llama",
# need `kind` set in their config)
STT_TYPES = frozenset({"whisper"})
# vision families the vision worker is known to serve (mlx-vlm's model_type); a folder of
# another family with a vision tower stays a text model (mlx-lm loads the text part of
# those it knows) unless its config says kind = "vision"
VISION_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
TTS_TYPES = frozenset(
    {
        "qwen3_tts", "kokoro", "sesame", "dia", "outetts", "spark", "soprano", "bark",
        "chatterbox", "chatterbox_turbo", "melotts", "kitten_tts", "indextts", "voxcpm",
        "voxcpm2", "zonos2", "pocket_tts", "vibevoice", "higgs_audio", "echo_tts",
        "moss_tts", "voxtral_tts", "omnivoice",
    }
)  # fmt: skip
# Whisper's multilingual vocabularies have at least this many tokens (English-only: 51864)
WHISPER_MULTILINGUAL_VOCAB = 51865


def kind_of(config: ModelConfig) -> ModelKind:
    """The configured kind, else what the files say: a BERT-family encoder with a
    sequence-classification head is a reranker (a cross-encoder), a sentence-transformers
    folder (modules.json) or a plain BERT-family encoder an embedding model, anything else a
    text model (a hub id not downloaded yet too: set `kind` for one that is not)."""
    if config.kind is not None:
        return config.kind
    if config.source == MINILM_SOURCE:
        return ModelKind.EMBEDDING
    if config.source == DEMO_SOURCE:
        return ModelKind.LLM
    generated = {
        VISION_DEMO_SOURCE: ModelKind.VISION,
        STT_DEMO_SOURCE: ModelKind.TRANSCRIPTION,
        TTS_DEMO_SOURCE: ModelKind.SPEECH,
    }
    if config.source in generated:
        return generated[config.source]
    return kind_in(Path(config.source).expanduser())


def kind_served(config: ModelConfig, capabilities: Sequence[str] | None) -> ModelKind:
    """The kind as its last worker showed it (what it served), else kind_of: a hub id with
    no `kind` is known once its worker had the files."""
    if config.kind is not None or capabilities is None:
        return kind_of(config)
    if "embeddings" in capabilities:
        return ModelKind.EMBEDDING
    if "rerank" in capabilities and "completion" not in capabilities:
        return ModelKind.RERANK
    if "transcription" in capabilities:
        return ModelKind.TRANSCRIPTION
    if "speech" in capabilities:
        return ModelKind.SPEECH
    return ModelKind.VISION if "vision" in capabilities else ModelKind.LLM


def kind_in(path: Path) -> ModelKind:
    """What a model folder's files say it is (see kind_of); a worker asks once a hub id is
    downloaded. A model with a vision tower (`vision_config`) and an image processor is a
    vision model (mlx-vlm's)."""
    try:
        raw = _json(path / "config.json") or {}
        st = (path / "modules.json").is_file()
        images = (path / "preprocessor_config.json").is_file()
    except (OSError, ValueError):
        return ModelKind.LLM
    if raw.get("model_type") in VISION_TYPES and raw.get("vision_config") and images:
        return ModelKind.VISION
    if raw.get("model_type") in STT_TYPES:
        return ModelKind.TRANSCRIPTION
    if raw.get("model_type") in TTS_TYPES:
        return ModelKind.SPEECH
    encoder = raw.get("model_type") in ENCODER_TYPES
    heads = [a for a in raw.get("architectures") or [] if a.endswith("ForSequenceClassification")]
    if encoder and heads:
        return ModelKind.RERANK
    return ModelKind.EMBEDDING if st or encoder else ModelKind.LLM


def served_by(config: ModelConfig, kind: ModelKind | None = None) -> list[str] | None:
    """What an embedding model, a reranker or a speech model serves (None for a text or
    vision model: its worker says); `kind`: as the worker found it, else kind_of(config)."""
    kind = kind or kind_of(config)
    if kind is ModelKind.RERANK:
        return ["rerank"]
    if kind is ModelKind.SPEECH:
        return ["speech"]
    if kind is ModelKind.TRANSCRIPTION:
        raw = _json(Path(config.source).expanduser() / "config.json") or {}
        if not raw and config.source not in (STT_DEMO_SOURCE,):
            return None  # a hub id not downloaded yet: its worker will say
        vocab = raw.get("n_vocab") or raw.get("vocab_size") or 0
        multilingual = not raw or vocab >= WHISPER_MULTILINGUAL_VOCAB
        return ["transcription", *(["translation"] if multilingual else [])]
    if kind is ModelKind.EMBEDDING:
        return ["embeddings", *(["rerank"] if config.similarity_rerank else [])]
    return None


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
    not downloaded yet or a directory that cannot be read. An embedding model's context is
    known once loaded (its encoder's and sentence-transformers' limits)."""
    served = served_by(config)
    if served is not None:
        return None, served
    path = Path(config.source).expanduser()
    if not (path / "config.json").is_file():
        return None, None
    try:
        served = text_capabilities(has_chat_template_files(path))
        if (config.kind or kind_in(path)) is ModelKind.VISION:
            served.append("vision")
        return context_length(path, config), served
    except (OSError, ValueError):
        return None, None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None


SAFETENSORS_HEADER_MAX = 100 * 2**20  # a header larger than this is not a safetensors file


def model_identity(path: Path) -> str:
    """The weights a folder holds, as a digest: its config.json, and each safetensors file's
    name and header (every tensor's name, dtype, shape and offsets), read without the tensor
    data. Two replicas of a model must agree on it; "" for a folder without either."""
    digest = hashlib.sha256()
    found = False
    config = path / "config.json"
    if config.is_file():
        digest.update(b"config.json\0" + config.read_bytes())
        found = True
    for weights in sorted(path.glob("*.safetensors")):
        with open(weights, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = f.read(size) if size <= SAFETENSORS_HEADER_MAX else b""
        digest.update(weights.name.encode() + b"\0" + header)
        found = True
    return f"sha256:{digest.hexdigest()[:32]}" if found else ""
