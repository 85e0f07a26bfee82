"""gateway/api/common.py: the helpers the three protocols' translators share."""

from __future__ import annotations

import msgspec
import pytest

from gateway.api.common import decode_body, sampling, unsupported
from gateway.errors import GatewayError


class Body(msgspec.Struct):
    model: str


def test_a_field_left_out_takes_the_common_default() -> None:
    params = sampling(7, None, None)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 1.0, 1.0, 0)
    params = sampling(None, 0.0, 0.5, -3, stop=["x"])
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (0.0, 0.5, 0, ["x"])


def test_an_unsupported_parameter_is_named_with_why() -> None:
    error = unsupported("tools", "tool calling is not served yet")
    assert (error.status, error.param) == (400, "tools")
    assert error.message == "`tools` is not supported: tool calling is not served yet"
    assert unsupported("suffix").message == "`suffix` is not supported"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(b"", "empty"), (b"{", "not valid JSON"), (b'{"model": 3}', "Expected `str`")],
)
def test_a_bad_body_is_a_400_saying_what_is_wrong(raw: bytes, needle: str) -> None:
    with pytest.raises(GatewayError) as caught:
        decode_body(raw, Body)
    assert caught.value.status == 400 and needle in caught.value.message
    assert decode_body(b'{"model": "m"}', Body) == Body("m")


class Loose(msgspec.Struct):
    value: object = None


def test_a_body_nested_too_deep_is_a_400_not_a_crash() -> None:
    deep = b'{"value": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(GatewayError) as caught:
        decode_body(deep, Loose)
    assert caught.value.status == 400 and "nested too deeply" in caught.value.message
