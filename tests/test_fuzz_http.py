"""Fuzzed HTTP bodies (issue 24): any JSON a client can send to an endpoint gets a 2xx, or a
4xx in the protocol's own error shape; never a 5xx. Hypothesis generates bodies around each
endpoint's fields (right types and wrong ones, unknown fields, deep nesting) and sends them
to the gateway's real app (its middleware, routes and translators) in process, in front of a
scripted stand-in for the workers that answers as each kind of worker does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.scripted_workers import scripted_app


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return scripted_app(tmp_path_factory.mktemp("fuzz"))


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"])},
    optional={"content": JSON | st.text(max_size=20), "name": JSON, "tool_calls": JSON},
)


def often(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value the field takes, sometimes any JSON."""
    return st.one_of(valid, valid, valid, JSON)


TEXT = st.text(max_size=16)
HI = {"role": "user", "content": "hi"}
USER = st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})
SMALL = st.integers(min_value=1, max_value=8)

# each endpoint: (path, a body it serves, its fields and values to try for them)
ENDPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "text", "messages": [HI]}, {
        "model": often(st.sampled_from(["text", "embed", "nope"])),
        "messages": often(st.lists(st.one_of(USER, MESSAGE), min_size=1, max_size=3)),
        "max_tokens": often(SMALL), "temperature": often(st.floats(0, 2)),
        "top_p": often(st.floats(0, 1)), "stream": often(st.booleans()),
        "n": often(st.integers(1, 3)), "stop": often(st.lists(TEXT, max_size=2)),
        "logprobs": often(st.booleans()), "top_logprobs": often(st.integers(0, 5)),
        "seed": often(st.integers(-(2**63), 2**64)), "tools": JSON, "tool_choice": JSON,
        "response_format": often(st.just({"type": "json_object"})), "logit_bias": JSON,
        "user": often(TEXT), "stream_options": often(st.just({"include_usage": True})),
        "reasoning_effort": JSON, "unknown_field": JSON,
    }),
    "completions": ("/v1/completions", {"model": "text", "prompt": "hi"}, {
        "model": often(st.sampled_from(["text", "nope"])),
        "prompt": often(TEXT | st.lists(st.integers(0, 400), min_size=1, max_size=4)),
        "max_tokens": often(SMALL), "echo": often(st.booleans()),
        "logprobs": often(st.integers(0, 5)), "suffix": JSON, "best_of": JSON,
        "stream": often(st.booleans()),
    }),
    "embeddings": ("/v1/embeddings", {"model": "embed", "input": "hi"}, {
        "model": often(st.sampled_from(["embed", "text"])),
        "input": often(TEXT | st.lists(TEXT, min_size=1, max_size=3)),
        "encoding_format": often(st.sampled_from(["float", "base64"])),
        "dimensions": often(st.integers(1, 4)), "user": often(TEXT),
    }),
    "rerank": ("/v1/rerank", {"model": "embed", "query": "q", "documents": ["a"]}, {
        "model": often(st.sampled_from(["embed", "text"])), "query": often(TEXT),
        "documents": often(st.lists(TEXT, min_size=1, max_size=3)),
        "top_n": often(st.integers(1, 3)), "return_documents": often(st.booleans()),
    }),
    "messages": ("/v1/messages", {"model": "text", "max_tokens": 4, "messages": [HI]}, {
        "model": often(st.sampled_from(["text", "nope"])), "max_tokens": often(SMALL),
        "messages": often(st.lists(st.one_of(USER, MESSAGE), min_size=1, max_size=3)),
        "system": often(TEXT), "stream": often(st.booleans()), "tools": JSON,
        "tool_choice": JSON, "thinking": JSON, "stop_sequences": often(st.lists(TEXT, max_size=2)),
        "temperature": often(st.floats(0, 1)), "metadata": JSON,
    }),
    "responses": ("/v1/responses", {"model": "text", "input": "hi"}, {
        "model": often(st.sampled_from(["text", "nope"])),
        "input": often(TEXT | st.lists(USER, min_size=1, max_size=2)),
        "instructions": often(TEXT), "max_output_tokens": often(st.integers(16, 32)),
        "stream": often(st.booleans()), "tools": JSON, "text": JSON, "reasoning": JSON,
        "previous_response_id": JSON, "store": often(st.booleans()), "background": JSON,
    }),
    "speech": ("/v1/audio/speech", {"model": "tts", "input": "hi", "voice": "alloy"}, {
        "model": often(st.sampled_from(["tts", "text"])), "input": often(TEXT),
        "voice": often(TEXT), "speed": often(st.floats(0.25, 4)),
        "response_format": often(st.sampled_from(["mp3", "wav", "pcm", "flac"])),
        "stream_format": often(st.sampled_from(["audio", "sse"])),
    }),
}  # fmt: skip


def bodies(base: dict[str, Any], fields: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A body the endpoint serves with some of its fields drawn again (right values, wrong
    ones, unknown fields), or any JSON at all."""
    drawn = st.fixed_dictionaries({}, optional=fields).map(lambda body: {**base, **body})
    return st.one_of(drawn, drawn, drawn, JSON)


def check(app: Any, path: str, body: Any) -> None:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, content=json.dumps(body), timeout=10)

    reply = asyncio.run(send())
    assert reply.status_code < 500, (path, body, reply.status_code, reply.text)
    if reply.status_code >= 400:
        error = reply.json()
        if path == "/v1/messages":
            assert error["type"] == "error" and error["error"]["message"], error
        else:
            assert error["error"]["message"] and "type" in error["error"], error


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_any_json_gets_a_2xx_or_a_4xx_in_the_protocols_shape(app: Any, endpoint: str) -> None:
    path, base, fields = ENDPOINTS[endpoint]

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,  # the same examples on every run: CI stays reproducible
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies(base, fields))
    def run(body: Any) -> None:
        check(app, path, body)

    run()
