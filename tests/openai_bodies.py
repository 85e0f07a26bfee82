"""OpenAI bodies in and out for the translate tests: a chat or completion body decoded
and translated to (canonical request, sampling), a rejection's error, and SSE events parsed
back to their JSON payloads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.common import decode_body
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.api.openai.translate import chat_request, completion_request
from gateway.errors import GatewayError
from shared.types import CanonicalRequest, ErrorCode, SamplingParams

USER = [{"role": "user", "content": "hi"}]


def enc(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def chat(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    body = {"model": "m", "messages": USER, **fields}
    return chat_request(decode_body(enc(body), ChatCompletionRequest))


def completions(**fields: Any) -> list[tuple[CanonicalRequest, SamplingParams]]:
    body = {"model": "m", "prompt": "Once", **fields}
    return completion_request(decode_body(enc(body), CompletionRequest))


def completion(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    """A single-prompt completion body: its one (canonical, sampling) pair."""
    (job,) = completions(**fields)
    return job


def rejected(call: Any, *args: Any, **kwargs: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        call(*args, **kwargs)
    error = info.value
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.status == 400
    return error


def sse(data: bytes) -> list[Any]:
    """Complete SSE events -> their JSON payloads ("[DONE]" stays a string)."""
    assert data.endswith(b"\n\n"), data
    events = []
    for event in data.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: "), event
        payload = event[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def one(data: bytes) -> dict[str, Any]:
    (event,) = sse(data)
    assert isinstance(event, dict)
    return event
