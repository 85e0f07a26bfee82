"""Streaming detokenizers (worker/engine/detokenize.py) on real tokenizers: the deltas joined
are exactly tokenizer.decode(tokens), one token at a time, also inside UTF-8 characters."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from mlx_lm import load

from worker.engine.detokenize import (
    SegmentDecoder,
    StreamDecoder,
    detokenizer_factory,
)
from worker.modelgen import byte_token_id


def _tokenizer(path: Path) -> Any:
    return load(str(path))[1]


def _streamed(detok: Any, tokens: list[int]) -> tuple[list[str], str]:
    deltas = [detok.add(t) for t in tokens]
    return deltas, detok.finish()


def _sequences(tokenizer: Any, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    text = " Hello there,\n world.  Café 日本 🙂 tabs\tand   spaces "
    return [
        list(tokenizer.encode(text)),
        *[[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(200)],
    ]


def test_a_fast_tokenizer_streams_through_decode_stream(chat_model: Path) -> None:
    tokenizer = _tokenizer(chat_model)
    make = detokenizer_factory(tokenizer)
    assert isinstance(make(), StreamDecoder)
    for tokens in _sequences(tokenizer, 0):
        deltas, tail = _streamed(make(), tokens)
        assert "".join(deltas) + tail == tokenizer.decode(tokens)


def test_byte_tokens_wait_for_the_whole_character(bytes_model: Path) -> None:
    tokenizer = _tokenizer(bytes_model)
    make = detokenizer_factory(tokenizer)
    c3, a9 = byte_token_id(bytes_model, 0xC3), byte_token_id(bytes_model, 0xA9)
    a = byte_token_id(bytes_model, 0x61)
    detok = make()
    assert [detok.add(t) for t in (a, c3, a9, c3)] == ["a", "", "\u00e9", ""]
    assert detok.finish() == tokenizer.decode([a, c3, a9, c3])[len("a\u00e9") :]  # U+FFFD
    for tokens in _sequences(tokenizer, 1):
        deltas, tail = _streamed(make(), tokens)
        assert "".join(deltas) + tail == tokenizer.decode(tokens)


def test_the_first_delta_keeps_a_leading_space(chat_model: Path) -> None:
    tokenizer = _tokenizer(chat_model)
    tokens = list(tokenizer.encode(" leading space"))
    assert tokenizer.decode(tokens).startswith(" ")
    for detok in (
        detokenizer_factory(tokenizer)(),
        SegmentDecoder(tokenizer.detokenizer, tokenizer.decode),
    ):
        deltas, tail = _streamed(detok, tokens)
        assert "".join(deltas) + tail == tokenizer.decode(tokens)
        assert next(d for d in deltas if d).startswith(" ")


def test_the_tokenizers_own_detokenizer_is_exact_on_text(
    chat_model: Path, bytes_model: Path
) -> None:
    """The slow path (mlx-lm's streaming detokenizers) matches decode on real text; on
    arbitrary id sequences it may not, which is one reason the fast path is preferred."""
    for path in (chat_model, bytes_model):
        tokenizer = _tokenizer(path)
        texts = ["Hello there, world.", " A leading space", "Two\nlines  and  gaps", "Café 🙂"]
        for tokens in [list(tokenizer.encode(t)) for t in texts]:
            detok = SegmentDecoder(tokenizer.detokenizer, tokenizer.decode)
            deltas, tail = _streamed(detok, tokens)
            assert "".join(deltas) + tail == tokenizer.decode(tokens)


class _PostProcessing:
    """A tokenizer whose decode rewrites the text (as some model-specific tokenizers do):
    the fast path would not reproduce it, so the factory must not pick it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.backend_tokenizer = inner.backend_tokenizer

    def __len__(self) -> int:
        return len(self._inner)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self._inner.encode(text, **kwargs))

    def decode(self, tokens: list[int]) -> str:
        return self._inner.decode(tokens).replace("e", "E")

    @property
    def detokenizer(self) -> Any:
        return self._inner.detokenizer


def test_a_decode_the_stream_cannot_reproduce_keeps_the_slow_path(chat_model: Path) -> None:
    tokenizer = _PostProcessing(_tokenizer(chat_model))
    assert isinstance(detokenizer_factory(tokenizer)(), SegmentDecoder)
