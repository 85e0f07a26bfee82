"""An embedding model's or a reranker's worker parts, from its resolved folder."""

from __future__ import annotations

from pathlib import Path

from shared.config import ModelConfig, ModelKind
from worker.embeddings.encoder import Encoder
from worker.embeddings.engine import EmbeddingEngine
from worker.embeddings.preprocess import EmbeddingPreprocessor
from worker.loader import LoadError


def open_encoder(
    config: ModelConfig, path: Path, kind: ModelKind
) -> tuple[EmbeddingEngine, EmbeddingPreprocessor]:
    """The engine and the preprocessor of the encoder at `path`, which must be what `kind`
    says (a cross-encoder for a reranker, a plain encoder for an embedding model)."""
    if kind is ModelKind.RERANK:
        only_for_embeddings(config, kind)
    try:
        encoder = Encoder(path)
    except (OSError, ValueError) as exc:
        raise LoadError(f"model {config.name!r}: cannot load {path}: {exc}") from exc
    if encoder.scores != (kind is ModelKind.RERANK):
        found = "a cross-encoder (a reranker)" if encoder.scores else "an embedding model"
        raise LoadError(f"model {config.name!r} is configured as {kind}, but {path} is {found}")
    preprocess = EmbeddingPreprocessor(
        encoder, config.engine, config.similarity_rerank, config.matryoshka
    )
    return EmbeddingEngine(encoder, config.engine), preprocess


def only_for_embeddings(config: ModelConfig, kind: ModelKind) -> None:
    """Keys of an embedding model's config on another kind: a load error, never ignored."""
    for key in ("similarity_rerank", "matryoshka"):
        if getattr(config, key):
            raise LoadError(
                f"model {config.name!r}: {key} is for embedding models; this one is {kind}"
            )
