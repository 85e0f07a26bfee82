"""A large byte-level BPE vocabulary, trained offline, for benchmarks that need a real vocab size.

No model hub is reachable from the benchmark machines, and mask computation for structured
output scales with the vocabulary: the tiny test models' 400-512 tokens say nothing about a
128k-token Llama 3 vocabulary. This trains a byte-level BPE (every byte representable, GPT-2
pre-tokenization, `<|endoftext|>` = id 0 as EOS) on English-ish prose from `worker.corpus`
plus generated JSON, so the vocabulary also holds the multi-character JSON tokens (`":"`,
`"},{"`, ...) that real tokenizers have. Deterministic for a size and seed; cached on disk.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from worker.corpus import builtin_corpus
from worker.engine.tokens import byte_to_unicode

EOS = "<|endoftext|>"
EOS_ID = 0
SPECIALS = (EOS, "<|im_start|>", "<|im_end|>")
_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}
_KEYS = [
    *("id", "name", "type", "value", "items", "description", "status", "created_at", "email"),
    *("price", "quantity", "title", "content", "role", "message", "arguments", "unit", "date"),
    *("location", "time", "count", "total", "data", "error", "code", "label", "url", "tags"),
    *("children", "parent", "score", "enabled", "active", "version", "kind", "result", "query"),
]


def _json_value(rng: random.Random, words: list[str], depth: int) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randint(-999, 99999)
    if kind == 1:
        return round(rng.uniform(-1000, 1000), rng.randint(1, 4))
    if kind == 2:
        return rng.choice((True, False, None))
    if kind in (3, 4):
        return " ".join(rng.choices(words, k=rng.randint(1, 8)))
    if kind == 5:
        return [_json_value(rng, words, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = rng.choices(_KEYS if rng.random() < 0.7 else words, k=rng.randint(1, 5))
    return {k: _json_value(rng, words, depth + 1) for k in keys}


def training_text(chars: int, seed: int = 0) -> str:
    """About `chars` characters: two thirds prose, one third JSON in three layouts."""
    prose = builtin_corpus(max(8000, chars * 2 // 3))
    rng = random.Random(seed)
    words = sorted(set(prose.split()))[:5000]
    parts, size = [prose], len(prose)
    while size < chars:
        doc = {"type": "object", "data": _json_value(rng, words, 0)}
        layout = rng.choice(((",", ":"), (", ", ": "), None))
        parts.append(json.dumps(doc, separators=layout, indent=2 if layout is None else None))
        size += len(parts[-1])
    return "\n".join(parts)


def train_tokenizer(vocab_size: int, chars: int | None = None, seed: int = 0) -> str:
    """The tokenizer.json text of a byte-level BPE with `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = training_text(chars or max(20_000, vocab_size * 40), seed)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=list(byte_to_unicode().values()),
        show_progress=False,
    )
    chunks = (text[i : i + 100_000] for i in range(0, len(text), 100_000))
    tokenizer.train_from_iterator(chunks, trainer)
    if tokenizer.token_to_id(EOS) != EOS_ID:
        raise RuntimeError(f"{EOS} did not get id {EOS_ID}")
    return tokenizer.to_str()


def cached_tokenizer(vocab_size: int, cache_dir: str | Path | None = None, seed: int = 0) -> str:
    """train_tokenizer's result, kept under `cache_dir` (default: the temp dir) for reruns."""
    root = Path(cache_dir or Path(tempfile.gettempdir()) / "mlx-gateway-bench")
    path = root / f"bpe-{vocab_size}-seed{seed}.json"
    if path.exists():
        return path.read_text()
    text = train_tokenizer(vocab_size, seed=seed)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return text


def load_tokenizer(path: str | Path | None, vocab_size: int) -> str:
    """The tokenizer.json text at `path` (a file or a model directory), else a trained one."""
    if path is None:
        return cached_tokenizer(vocab_size)
    path = Path(path)
    return (path / "tokenizer.json" if path.is_dir() else path).read_text()


def one_byte_tokens(tokenizer_json: str) -> list[int]:
    """Ids of the tokens that are one ASCII byte other than whitespace."""
    items = token_bytes(tokenizer_json).items()
    return [i for i, raw in items if len(raw) == 1 and raw < b"\x80" and not raw.isspace()]


def token_bytes(tokenizer_json: str) -> dict[int, bytes]:
    """Each regular token's raw bytes (special tokens left out)."""
    vocab: dict[str, int] = json.loads(tokenizer_json)["model"]["vocab"]
    return {
        i: bytes(_UNICODE_TO_BYTE[c] for c in tok)
        for tok, i in vocab.items()
        if tok not in SPECIALS
    }
