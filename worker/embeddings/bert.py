"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: all-MiniLM, bge, e5, gte, multilingual
e5, ...) in MLX, loaded from a Hugging Face checkpoint's config.json and safetensors; and
the same encoders with a sequence-classification head of one label, the cross-encoders
that rerankers are (ms-marco-MiniLM, bge-reranker-base and -large, ...).

mlx-embeddings implements these too, but it is GPL-3.0 (this project is MIT) and pulls in
mlx-vlm and its dependencies; an encoder is a few layers of MLX's own modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from shared.modelinfo import ENCODER_TYPES


@dataclass(frozen=True, slots=True)
class BertConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    classifier: bool = False  # a *ForSequenceClassification checkpoint (one label)

    @classmethod
    def read(cls, path: Path) -> BertConfig:
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
        kind = raw.get("model_type", "")
        if kind not in ENCODER_TYPES:
            raise ValueError(
                f"model_type {kind!r} is not an encoder this worker runs "
                f"({', '.join(sorted(ENCODER_TYPES))})"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {raw['position_embedding_type']!r}")
        if raw.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {raw['hidden_act']!r}")
        classifier = any(
            a.endswith("ForSequenceClassification") for a in raw.get("architectures") or []
        )
        labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 1
        if classifier and labels != 1:
            raise ValueError(f"a classifier of {labels} labels is not a reranker (one label)")
        fields = set(cls.__dataclass_fields__) - {"classifier"}
        return cls(**{k: v for k, v in raw.items() if k in fields}, classifier=classifier)

    @property
    def position_offset(self) -> int:
        """RoBERTa numbers positions from pad_token_id + 1."""
        return 0 if self.model_type == "bert" else self.pad_token_id + 1

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings - self.position_offset


_ACTIVATIONS = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "relu": nn.relu, "silu": nn.silu}


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.offset = c.position_offset

    def __call__(self, ids: mx.array, types: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None] + self.offset
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(types))


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)


class _Dense(nn.Module):
    """A dense layer, then the residual, then LayerNorm (BERT's "output" blocks)."""

    def __init__(self, dims_in: int, dims: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(dims_in, dims)
        self.LayerNorm = nn.LayerNorm(dims, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        setattr(self, "self", _SelfAttention(c))  # noqa: B010  (the checkpoint's name)
        self.output = _Dense(c.hidden_size, c.hidden_size, c.layer_norm_eps)
        self.heads = c.num_attention_heads

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        inner: _SelfAttention = self["self"]
        b, n, d = x.shape
        h = self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(inner.query(x)), split(inner.key(x)), split(inner.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=(d // h) ** -0.5, mask=mask)
        return self.output(out.transpose(0, 2, 1, 3).reshape(b, n, d), x)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = _ACTIVATIONS[c.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Dense(c.intermediate_size, c.hidden_size, c.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = [_Layer(c) for _ in range(c.num_hidden_layers)]


class BertModel(nn.Module):
    """Token states (batch, tokens, hidden) of right-padded ids; `mask` 1 on real tokens."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        x = self.embeddings(ids, types if types is not None else mx.zeros_like(ids))
        dtype = x.dtype
        keep = mask[:, None, None, :].astype(mx.bool_)
        additive = mx.where(keep, mx.array(0, dtype), mx.array(-mx.inf, dtype))
        for layer in self.encoder.layer:
            x = layer(x, additive)
        return x


class _Head(nn.Module):
    """RoBERTa's classification head: dense, tanh, out_proj over the first token."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, 1)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))


class _Pooler(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)


class CrossEncoder(BertModel):
    """One relevance logit per row (batch, ) of a (query, document) pair's ids, its
    `types` 1 on the document's tokens: BERT's pooler then classifier, or RoBERTa's head."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        if config.model_type == "bert":
            self.pooler = _Pooler(config)
            self.classifier: nn.Module = nn.Linear(config.hidden_size, 1)
        else:
            self.classifier = _Head(config)

    def logits(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        first = self(ids, mask, types)[:, 0]
        if self.config.model_type == "bert":
            return self.classifier(mx.tanh(self.pooler.dense(first)))[:, 0]
        return self.classifier(first)[:, 0]


def load_bert(path: Path, dtype: mx.Dtype | None = None) -> BertModel:
    """The encoder in `path` (config.json, *.safetensors), a CrossEncoder for a
    sequence-classification checkpoint; weights of heads it does not use (pooler,
    masked-LM) are left out, a missing or misshapen weight is an error."""
    config = BertConfig.read(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    model = CrossEncoder(config) if config.classifier else BertModel(config)
    heads: tuple[str, ...] = ()
    if config.classifier:  # RoBERTa's head has no pooler (a checkpoint may carry one)
        heads = ("pooler.", "classifier.") if config.model_type == "bert" else ("classifier.",)
    prefixes = ("bert.", "roberta.", "model.")
    kept = []
    for name, value in weights.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(("embeddings.", "encoder.", *heads)) and not name.endswith(
            "position_ids"
        ):
            kept.append((name, value.astype(dtype) if dtype is not None else value))
    model.load_weights(kept, strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model
