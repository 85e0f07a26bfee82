"""Bad input gets a 4xx in OpenAI's error shape and never wedges anything."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.gateway_proc import GatewayProc

OK_MESSAGES = [{"role": "user", "content": "hi"}]


def _post(gateway: GatewayProc, path: str, body: Any, raw: bytes | None = None) -> httpx.Response:
    url = f"{gateway.base_url}/v1/{path}"
    if raw is not None:
        return httpx.post(url, content=raw, headers={"content-type": "application/json"})
    return httpx.post(url, json=body, timeout=30)


def _assert_openai_error(r: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], error
    return error


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "chat", "messages": OK_MESSAGES, "max_tokens": "ten"}, "max_tokens"),
        ({"model": "chat", "messages": OK_MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"model": "chat", "messages": OK_MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"model": "chat", "messages": OK_MESSAGES, "temperature": -1}, "temperature"),
        ({"model": "chat", "messages": OK_MESSAGES, "top_p": 1.5}, "top_p"),
        ({"model": "chat", "messages": []}, "messages"),
        ({"model": "chat"}, "messages"),
        ({"messages": OK_MESSAGES}, "model"),
        ({"model": "chat", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "chat", "messages": OK_MESSAGES, "frobnicate": 1}, "frobnicate"),
        ({"model": "chat", "messages": OK_MESSAGES, "n": 0}, "n"),
        ({"model": "chat", "messages": OK_MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        ({"model": "chat", "messages": OK_MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"model": "chat", "messages": OK_MESSAGES, "stop": 5}, "stop"),
        ({"model": "chat", "messages": OK_MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
        ([1, 2, 3], "object"),
    ],
)
def test_chat_validation_errors(gateway: GatewayProc, body: Any, needle: str) -> None:
    error = _assert_openai_error(_post(gateway, "chat/completions", body), 400, needle)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b'{"model": "chat", "messages": [', b"\xff\xfe"]
)
def test_invalid_json(gateway: GatewayProc, raw: bytes) -> None:
    _assert_openai_error(_post(gateway, "chat/completions", None, raw=raw), 400)


def test_completion_validation(gateway: GatewayProc) -> None:
    _assert_openai_error(_post(gateway, "completions", {"model": "chat", "prompt": ""}), 400)
    body = {"model": "chat", "prompt": ["a", ""]}
    _assert_openai_error(_post(gateway, "completions", body), 400, "prompt 1 is empty")
    body = {"model": "chat", "prompt": "a", "max_tokens": 0}
    _assert_openai_error(_post(gateway, "completions", body), 400, "only allowed with echo")
    body = {"model": "chat", "prompt": "a", "suffix": "b"}
    _assert_openai_error(_post(gateway, "completions", body), 400, "suffix")
    body = {"model": "chat", "prompt": [999999]}
    _assert_openai_error(_post(gateway, "completions", body), 400, "vocabulary")


def test_unknown_model_is_404_naming_available(gateway: GatewayProc) -> None:
    body = {"model": "nope", "messages": OK_MESSAGES}
    error = _assert_openai_error(_post(gateway, "chat/completions", body), 404, "nope", "chat")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_over_long_prompt_is_400(gateway: GatewayProc, stream: bool) -> None:
    body = {
        "model": "other",  # max_context 256
        "messages": [{"role": "user", "content": "word " * 600}],
        "stream": stream,
    }
    error = _assert_openai_error(_post(gateway, "chat/completions", body), 400, "context length")
    assert error["code"] == "context_length_exceeded"
    body = {"model": "other", "messages": OK_MESSAGES, "max_tokens": 1000}
    _assert_openai_error(_post(gateway, "chat/completions", body), 400, "context length")


def test_unknown_route_and_method(gateway: GatewayProc) -> None:
    _assert_openai_error(httpx.get(f"{gateway.base_url}/v1/nothing"), 404)
    _assert_openai_error(httpx.get(f"{gateway.base_url}/v1/chat/completions"), 405)


def test_body_too_large(gateway: GatewayProc) -> None:
    big = b'{"model": "chat", "messages": [{"role": "user", "content": "' + b"a" * (9 << 20)
    r = httpx.post(f"{gateway.base_url}/v1/chat/completions", content=big + b'"}]}', timeout=30)
    assert r.status_code == 413


def test_sdk_raises_typed_errors_and_gateway_still_serves(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=OK_MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chat", messages=OK_MESSAGES, temperature=-1)  # type: ignore[arg-type]
    r = client.chat.completions.create(model="chat", messages=OK_MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"-3": 5}}, "logit_bias"),
        ({"stop_token_ids": [999999]}, "stop_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary(
    gateway: GatewayProc, extra: dict[str, Any], needle: str
) -> None:
    body = {"model": "chat", "messages": OK_MESSAGES, **extra}
    error = _assert_openai_error(_post(gateway, "chat/completions", body), 400, "vocabulary")
    assert error["param"] == needle


def test_any_integer_seed_is_served(gateway: GatewayProc) -> None:
    for seed in (-1, 2**63 + 5):
        body = {"model": "chat", "messages": OK_MESSAGES, "seed": seed, "max_tokens": 3}
        r = _post(gateway, "chat/completions", body)
        assert r.status_code == 200, r.text
    # n > 1 adds the choice's index to a seed: the top of the range wraps, never overflows.
    body = {"model": "chat", "messages": OK_MESSAGES, "seed": 2**64 - 1, "n": 2, "max_tokens": 2}
    assert _post(gateway, "chat/completions", body).status_code == 200
    # Beyond 64 bits (or a token id beyond 32): a 400 naming the field, never a 500.
    for field, value in (("seed", 2**64), ("seed", -(2**63) - 1), ("max_tokens", 2**64)):
        body = {"model": "chat", "messages": OK_MESSAGES, field: value}
        error = _assert_openai_error(_post(gateway, "chat/completions", body), 400)
        assert error["param"] == field
    body = {"model": "chat", "messages": OK_MESSAGES, "logit_bias": {str(2**70): 1}}
    assert _post(gateway, "chat/completions", body).status_code == 400
    assert gateway.ps()["chat"]["state"] == "ready"
    assert gateway.ps()["chat"]["in_flight"] == 0
