"""An embedding model as the worker runs it: its encoder (worker/embeddings/bert.py), its
tokenizer (tokenizers, as tokenizer.json says, without its padding or truncation), and
sentence-transformers' pooling and normalization from the model's folder (1_Pooling,
modules.json), so a vector is the one sentence-transformers computes for the model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from worker.embeddings.bert import BertModel, CrossEncoder, load_bert

POOLINGS = ("mean", "cls", "max", "lasttoken")


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str = "mean"  # one of POOLINGS
    normalize: bool = True

    @classmethod
    def read(cls, path: Path) -> Pooling:
        """sentence-transformers' modules.json and its Pooling module's config; a folder
        without them is pooled by mean and normalized (what most embedding models use)."""
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        mode = "mean"
        for module in modules:
            if module.get("type", "").endswith(".Pooling"):
                raw = json.loads((path / module["path"] / "config.json").read_text())
                modes = [m for m in POOLINGS if raw.get(_KEYS[m])]
                if raw.get("pooling_mode_mean_sqrt_len_tokens") or len(modes) > 1:
                    raise ValueError(f"unsupported pooling in {module['path']}: {raw}")
                mode = modes[0] if modes else "mean"
        return cls(mode, normalize)

    def __call__(self, states: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
        if self.mode == "cls":
            pooled = states[:, 0]
        elif self.mode == "lasttoken":
            pooled = mx.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0]
        elif self.mode == "max":
            keep = mask[..., None].astype(mx.bool_)
            pooled = mx.where(keep, states, mx.array(-mx.inf, states.dtype)).max(axis=1)
        else:
            weights = mask[..., None].astype(states.dtype)
            pooled = (states * weights).sum(axis=1) / weights.sum(axis=1)
        if self.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled


_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


class Encoder:
    """Texts or token ids -> float32 vectors, a batch at a time; for a cross-encoder, (query,
    document) pairs -> relevance scores (the sigmoid of its logit, as sentence-transformers'
    CrossEncoder gives for one label), as vectors of one dimension."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model: BertModel = load_bert(path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.pooling = Pooling.read(path)
        self.max_tokens = self._max_tokens()
        self.scores = isinstance(self.model, CrossEncoder)
        self.dimensions = 1 if self.scores else self.model.config.hidden_size
        self.vocab_size = self.model.config.vocab_size
        self.pad_id = self.model.config.pad_token_id  # masked out: any id would do

    def _max_tokens(self) -> int:
        """sentence-transformers' max_seq_length where the folder has one, within the
        encoder's positions."""
        limit = self.model.config.max_tokens
        st = self.path / "sentence_bert_config.json"
        if st.is_file():
            limit = min(limit, int(json.loads(st.read_text()).get("max_seq_length", limit)))
        return limit

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def pairs(self, query: str, documents: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """A cross-encoder's inputs: each (query, document) pair's ids and token types."""
        encodings = self.tokenizer.encode_batch([(query, d) for d in documents])
        return [e.ids for e in encodings], [e.type_ids for e in encodings]

    def embed(self, batch: list[list[int]], types: list[list[int]] | None = None) -> np.ndarray:
        """(len(batch), dimensions) float32 vectors of token id lists (each already within
        max_tokens, special tokens included), or a cross-encoder's (len(batch), 1) scores."""
        width = max(len(ids) for ids in batch)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.int32)
        kinds = np.zeros((len(batch), width), dtype=np.int32)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
            if types is not None:
                kinds[row, : len(tokens)] = types[row]
        mask_mx = mx.array(mask)
        if isinstance(self.model, CrossEncoder):
            logits = self.model.logits(mx.array(ids), mask_mx, mx.array(kinds))
            return np.array(mx.sigmoid(logits.astype(mx.float32)))[:, None]
        lengths = mx.array([len(tokens) for tokens in batch])
        states = self.model(mx.array(ids), mask_mx, mx.array(kinds))
        vectors = self.pooling(states, mask_mx, lengths).astype(mx.float32)
        return np.array(vectors)
