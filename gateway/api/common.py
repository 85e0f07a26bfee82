"""What the three protocols' translators share: their 400s (invalid input, an unsupported
parameter named), decoding a request body, and the sampling defaults a field left out means."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from gateway.errors import GatewayError, validation_error
from shared.types import ErrorCode, SamplingParams

T = TypeVar("T")


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def unsupported(param: str, detail: str = "") -> GatewayError:
    """A parameter this gateway does not serve, named, with why."""
    return invalid(f"`{param}` is not supported" + (f": {detail}" if detail else ""), param)


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
