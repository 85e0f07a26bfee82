"""A vision model's requests, prepared on the input thread: images decoded and put through
the model's own processor and chat template, and the prompt keyed for the prefix cache by
the images' content.

Each image part becomes `{"type": "image"}` in its message's content, where the client put
it, so that the model's chat template places its marker; the processor then expands each
marker into the image's tokens and makes its arrays (resizing and normalizing: the costly
part of an image that does not need the model). The prefix cache keys tokens, and every
image's tokens are the same placeholder id: the key gives each of them an id made from the
image's bytes instead (past the vocabulary), so that only the same image reuses its KV.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import AudioPart, CanonicalRequest, ImagePart, TextPart
from worker.backends.formats import ModelFormats
from worker.backends.mlx_vlm import Media, prepare
from worker.preprocess import PreparedRequest, Preprocessor, _invalid, _message_dict

# OpenAI's detail "low": the image at most this many pixels on its longest side
LOW_DETAIL_SIDE = 512
DETAILS = ("auto", "low", "high")


class VisionPreprocessor(Preprocessor):
    by_segments = False  # its prompts stay whole: the processor's, or the template's ids

    def __init__(
        self,
        tokenizer: Any,
        processor: Any,
        image_token: int | None,
        options: EngineOptions,
        max_context: int,
        formats: ModelFormats | None = None,
    ) -> None:
        super().__init__(tokenizer, options, max_context, formats)
        self.processor = processor
        self.image_token = image_token
        # the request being prepared: (PIL image, what keys it in the prefix cache)
        self._images: list[tuple[Any, bytes]] = []
        self._media: tuple[Media, list[int]] | None = None

    def __call__(self, frame: Add) -> PreparedRequest:
        self._images, self._media = [], None
        try:
            prepared = super().__call__(frame)
            if self._media is not None:
                prepared.media, key = self._media
                prepared.key = key + prepared.prompt[len(key) :]  # and what was resumed
            return prepared
        finally:
            self._images, self._media = [], None

    def tokenize_call(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().tokenize_call(args)
        finally:  # a count's images are no request's
            self._images, self._media = [], None

    def _messages(self, request: CanonicalRequest) -> list[dict[str, Any]]:
        self._images, self._media = [], None  # a new rendering: its own images only
        messages = []
        for i, m in enumerate(request.messages):
            message = _message_dict(m)
            if m.parts:
                message["content"] = [self._part(part, i, j) for j, part in enumerate(m.parts)]
            messages.append(message)
        return messages

    def _part(self, part: Any, i: int, j: int) -> dict[str, Any]:
        where = f"messages[{i}].content[{j}]"
        if isinstance(part, TextPart):
            return {"type": "text", "text": part.text}
        if isinstance(part, AudioPart):
            raise _invalid("this model takes no audio", where)
        assert isinstance(part, ImagePart)
        where = part.where or where
        # what the model sees of it: its bytes, and whether they were shrunk (detail "low")
        seen = part.data + (b"\0detail=low" if part.detail == "low" else b"")
        self._images.append((decode(part, where), seen))
        return {"type": "image"}

    def _render(
        self, messages: list[dict[str, Any]], request: CanonicalRequest, kwargs: dict[str, Any]
    ) -> Any:
        if not self._images:
            return super()._render(messages, request, kwargs)
        text = self._template(messages, request, kwargs, tokenize=False)
        if not isinstance(text, str):
            raise _invalid("the chat template did not render text", "messages")
        try:
            ids, media = prepare(self.processor, text, [image for image, _ in self._images])
        except Exception as exc:
            raise _invalid(f"the model's processor rejected the images: {exc}", "messages") from exc
        self._media = (
            media,
            content_key(ids, self.image_token, [data for _, data in self._images], self.vocab_size),
        )
        return ids


def decode(part: ImagePart, where: str) -> Any:
    """The image as RGB pixels (PIL); a 400 naming the part when it is not one."""
    from PIL import Image, UnidentifiedImageError

    if part.url is not None and not part.data:
        raise _invalid(f"the image at `{where}` was not fetched", where)
    if part.detail is not None and part.detail not in DETAILS:
        raise _invalid(f"detail must be one of {', '.join(DETAILS)}", f"{where}.detail")
    try:
        with Image.open(io.BytesIO(part.data)) as opened:
            opened.load()
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise _invalid(f"`{where}` is not an image that can be decoded: {exc}", where) from exc
    if part.detail == "low" and max(image.size) > LOW_DETAIL_SIDE:
        image.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
    return image


def content_key(
    ids: list[int], image_token: int | None, images: list[bytes], vocab_size: int
) -> list[int]:
    """The prompt with each image token replaced by an id of (its image's bytes, its place
    in the image), past the vocabulary. Images are the runs of image tokens, in order; where
    the runs do not match the images one to one (images side by side), every image token
    is keyed by all the prompt's images together."""
    runs = []
    previous = False
    for t in ids:
        if t == image_token and not previous:
            runs.append(0)
        previous = t == image_token
    digests = [hashlib.sha256(data).digest() for data in images]
    if len(runs) != len(images):
        digests = [hashlib.sha256(b"".join(digests)).digest()] * len(runs)
    key = []
    image, place, previous = -1, 0, False
    for t in ids:
        if t != image_token:
            key.append(t)
            previous = False
            continue
        if not previous:
            image, place = image + 1, 0
        seed = digests[image] + place.to_bytes(4, "little")
        key.append(vocab_size + int.from_bytes(hashlib.blake2b(seed, digest_size=4).digest()))
        place, previous = place + 1, True
    return key
