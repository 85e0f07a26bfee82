"""What a single token is: its text (decoded alone) and its own bytes, for logprobs."""

from __future__ import annotations

from typing import Any


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: visible latin-1 bytes stand for themselves, the rest
    are shifted to U+0100 and up, in byte order."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in visible}
    shifted = [b for b in range(256) if b not in table]
    table.update({b: chr(0x100 + i) for i, b in enumerate(shifted)})
    return table


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}
_SPM_SPACE = "\u2581".encode()


class TokenInfo:
    """Per-token text and bytes, cached. A token that is part of a UTF-8 character (a byte
    token, or a byte-level BPE piece) decodes alone to U+FFFD, but its bytes are its own:
    joined, the bytes of a run of tokens are exactly the text they make."""

    def __init__(self, tokenizer: Any, kind: str) -> None:
        """kind: "bpe" (byte-level BPE), "spm" (SentencePiece) or "text" (decode alone)."""
        self.tokenizer = tokenizer
        self._tokenmap: list[Any] | None = getattr(tokenizer.detokenizer, "tokenmap", None)
        self._kind = kind
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def raw(self, token: int) -> bytes:
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._bytes[token] = self._raw(token)
        return raw

    def _raw(self, token: int) -> bytes:
        tokenmap = self._tokenmap
        if tokenmap is not None and 0 <= token < len(tokenmap):
            piece = tokenmap[token]
            if self._kind == "bpe" and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            if self._kind == "spm" and isinstance(piece, bytes):
                return piece.replace(_SPM_SPACE, b" ")
        return self.text(token).encode("utf-8")
