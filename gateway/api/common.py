"""What the three protocols' translators share: their 400s (invalid input, an unsupported
parameter named), decoding a request body, the sampling defaults a field left out means,
and the neutral message model's pieces (images from URLs or base64, text of parts) with the
record of what a request uses that no worker serves yet."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

import msgspec

from gateway.errors import GatewayError, validation_error
from shared.types import ContentPart, ErrorCode, ImagePart, SamplingParams, TextPart

T = TypeVar("T")


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def unsupported(param: str, detail: str = "") -> GatewayError:
    """A parameter this gateway does not serve, named, with why."""
    return invalid(f"`{param}` is not supported" + (f": {detail}" if detail else ""), param)


# OpenAI's and Anthropic's rule for tool (and json_schema) names.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NAME_RULE = "1 to 64 letters, digits, underscores or dashes"


def check_name(name: str, where: str) -> None:
    """A tool's or schema's name, or a 400 naming `where`."""
    if not _NAME.fullmatch(name):
        got = f" (not {name!r})" if name else ""
        raise invalid(f"`{where}` must be {NAME_RULE}{got}", where)


def no_parameters() -> dict[str, Any]:
    """A tool's parameters when it gives none (a fresh dict each): no arguments."""
    return {"type": "object", "properties": {}}


def decode_body(body: bytes, type_: type[T]) -> T:
    """A request body as the protocol's request type, or a 400 naming what is wrong."""
    if not body:
        raise invalid("the request body is empty")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # nested deeper than the decoder follows
        raise invalid("the body is nested too deeply") from exc


def sampling(
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    **more: Any,
) -> SamplingParams:
    """Sampling parameters; a field the client left out (None) is the protocols' common
    default: temperature 1, top_p 1, no top_k."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(0, top_k or 0),
        **more,
    )


# ---- the neutral message model --------------------------------------------------------

# What a request may use beyond text, once a worker serves it: "image", "audio",
# "tool_calls" (an assistant's calls in the history), "tool_result", "reasoning". The
# translators map each onto the neutral message and refuse those not served yet, naming the
# protocol's field (the capabilities that serve them land their kind here). Images pass:
# a model that takes none is refused by the capability check ("vision"), and the gateway
# fetches and checks them for one that does (gateway/api/images.py).
SERVED: frozenset[str] = frozenset({"image", "tool_calls", "tool_result", "reasoning"})

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.I)


class Unserved:
    """What a request's content uses that workers may not serve, each with the 400 that
    names it in the request's own protocol; refused once the whole request is mapped."""

    def __init__(self) -> None:
        self.uses: list[tuple[str, GatewayError]] = []

    def add(self, feature: str, error: GatewayError) -> None:
        self.uses.append((feature, error))

    @property
    def features(self) -> list[str]:
        return [feature for feature, _ in self.uses]

    def refuse(self, served: Collection[str] = SERVED) -> None:
        for feature, error in self.uses:
            if feature not in served:
                raise error


def text_of(parts: Sequence[ContentPart]) -> str:
    return "".join(part.text for part in parts if isinstance(part, TextPart))


def media_parts(parts: list[ContentPart]) -> list[ContentPart]:
    """A message's parts as the neutral model keeps them: none when all are text."""
    return parts if any(not isinstance(part, TextPart) for part in parts) else []


def image_from_url(url: str, where: str, detail: str | None = None) -> ImagePart:
    """An image given by URL at `where` (the part's field, which its errors name): a data
    URL is decoded here; http(s) is kept for the gateway to fetch (gateway/api/images.py)."""
    if url.startswith(("http://", "https://")):
        return ImagePart(url=url, detail=detail, where=where)
    match = _DATA_URL.match(url)
    if match is None:
        raise invalid(
            f"`{where}` must be an http(s) URL or a base64 data URL (data:image/png;base64,...)",
            where,
        )
    data = image_bytes(url[match.end() :], where)
    return ImagePart(data, media_type=match["type"], detail=detail, where=where)


def image_bytes(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"`{where}` is not valid base64", where) from None
