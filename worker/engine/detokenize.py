"""Streaming detokenizers: each request's generated tokens turned into text as they come,
with the text of all deltas joined equal to `tokenizer.decode(tokens)`.

Where the tokenizer is a fast (`tokenizers`) one and its own decode does nothing more than
the Rust decoder, the `tokenizers` library's `DecodeStream` does the work: constant time a
token, whatever the length of the output. Anything else (slow tokenizers, decode with clean-up
or post-processing) goes through the tokenizer's own streaming detokenizer. Which one a model
gets is decided once, at load, by checking the fast path against `decode` on sample text.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Text the fast path must reproduce exactly: spaces, newlines, digits, punctuation and
# characters of two, three and four UTF-8 bytes.
PROBE_TEXT = (
    " Hello, world!\n\n  Indented   text\tand tabs. 3.14159 + 2 = 5.14159;"
    " naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🙂🚀 ✓ — “quotes” ..."
)
PROBE_IDS = 4096  # random ids decoded in runs, on top of the probe text


class Detokenizer(Protocol):
    def add(self, token: int) -> str:
        """Feed one token; the text it made readable (may be empty)."""
        ...

    def finish(self) -> str:
        """The text still held back (an incomplete character), at the end."""
        ...


class StreamDecoder:
    """`tokenizers.decoders.DecodeStream` over the tokenizer's Rust backend."""

    __slots__ = ("_backend", "_decode", "_held", "_sent", "_stream", "_tokens")

    def __init__(self, backend: Tokenizer, decode: Callable[[list[int]], str]) -> None:
        self._backend = backend
        self._decode = decode
        self._stream = DecodeStream(skip_special_tokens=False)
        self._tokens: list[int] = []
        self._sent = 0  # characters given out
        self._held = False  # the last token left bytes of an incomplete character behind

    def add(self, token: int) -> str:
        self._tokens.append(token)
        piece = self._stream.step(self._backend, token)
        self._held = piece is None
        if piece is None:
            return ""
        self._sent += len(piece)
        return piece

    def finish(self) -> str:
        # A stream ending inside a character holds its bytes back, where decode shows U+FFFD:
        # the tail is what the whole text has beyond what was given out (the check at load
        # showed the deltas are decode's text); otherwise nothing is held.
        if not self._held:
            return ""
        return self._decode(self._tokens)[self._sent :]


class SegmentDecoder:
    """The tokenizer's own streaming detokenizer (mlx-lm's `tokenizer.detokenizer`). Those
    trim the first segment's leading space; restore it, so that the text is exactly what
    decode returns."""

    __slots__ = ("_decode", "_detok", "_started")

    def __init__(self, detokenizer: Any, decode: Callable[[list[int]], str]) -> None:
        self._detok = detokenizer
        self._decode = decode
        self._started = False

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        return self._segment()

    def finish(self) -> str:
        self._detok.finalize()
        return self._segment()

    def _segment(self) -> str:
        text: str = self._detok.last_segment
        if text and not self._started:
            self._started = True
            full = self._decode(self._detok.tokens)
            lead = full[: len(full) - len(full.lstrip())]
            if lead and not text.startswith(lead) and full.startswith(lead + text):
                text = lead + text
        return text


def detokenizer_factory(tokenizer: Any) -> Callable[[], Detokenizer]:
    """What makes a request's detokenizer for this tokenizer (see the module's doc)."""
    decode: Callable[[list[int]], str] = tokenizer.decode
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and _stream_matches_decode(tokenizer, backend, decode):
        return lambda: StreamDecoder(backend, decode)
    return lambda: SegmentDecoder(tokenizer.detokenizer, decode)


def _stream_matches_decode(
    tokenizer: Any, backend: Tokenizer, decode: Callable[[list[int]], str]
) -> bool:
    vocab = len(tokenizer)
    rng = random.Random(0)
    runs = [list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))]
    ids = [rng.randrange(vocab) for _ in range(min(PROBE_IDS, 16 * vocab))]
    runs += [ids[i : i + 16] for i in range(0, len(ids), 16)]
    for run in runs:
        detok = StreamDecoder(backend, decode)
        text = "".join(detok.add(t) for t in run)
        try:
            full = decode(run)
        except Exception:  # an id the slow side cannot decode: no fast path
            return False
        if text + detok.finish() != full:
            return False
    return True
