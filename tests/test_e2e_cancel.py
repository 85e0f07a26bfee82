"""Cancel by request id (POST /v1/requests/{id}/cancel) and clients that leave, end to end:
real gateway and worker processes, the official openai SDK and httpx."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_proc import GatewayProc, wait_for

MESSAGES: Any = [{"role": "user", "content": "Tell me about the sea."}]


def post(gw: GatewayProc, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gw.base_url}{path}", json=body, timeout=60)


def cancel(gw: GatewayProc, request_id: str) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/v1/requests/{request_id}/cancel", timeout=30)


def assert_gone(gw: GatewayProc, request_id: str) -> None:
    """Cancelling again is a 404 once the request has ended. The gateway forgets it just
    after the stream's last byte, so allow it a moment; meanwhile nothing is cancelled."""
    deadline = time.monotonic() + 5
    while True:
        r = cancel(gw, request_id)
        if r.status_code == 404 or time.monotonic() > deadline:
            break
        assert r.json()["cancelled_choices"] == 0
        time.sleep(0.05)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not_found"
    assert r.json()["error"]["param"] == "request_id"


LONG: Any = {"ignore_eos": True}


def test_cancel_stream_by_id(client: openai.OpenAI, gateway: GatewayProc) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES, max_tokens=1800, stream=True, extra_body=LONG
    )
    request_id = raw.headers["x-request-id"]
    stream = raw.parse()
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    r = cancel(gateway, request_id)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": request_id, "object": "request.cancelled", "cancelled_choices": 1}
    with pytest.raises(openai.APIError) as info:
        for chunk in chunks:
            assert not (chunk.choices and chunk.choices[0].finish_reason)
    assert info.value.code == "cancelled"
    assert request_id in info.value.message
    assert_gone(gateway, request_id)


def test_cancel_n_choices_stream_over_http(gateway: GatewayProc) -> None:
    body = {
        "model": "chat",
        "messages": MESSAGES,
        "max_tokens": 1800,
        "n": 2,
        "stream": True,
        **LONG,
    }
    events: list[str] = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: ") :])
            if len(events) == 4:
                r = cancel(gateway, request_id)
                assert r.json()["cancelled_choices"] == 2
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "cancelled"
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert not any(finishes)  # neither choice finished: the error ended both
    assert_gone(gateway, request_id)


def test_cancel_non_stream_by_client_request_id(
    client: openai.OpenAI, gateway: GatewayProc
) -> None:
    """A non-streaming client learns x-request-id only with its answer: its own
    X-Request-Id names the request too."""

    own_id = f"client-{uuid.uuid4().hex[:8]}"
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            client.chat.completions.create(
                model="chat",
                messages=MESSAGES,
                max_tokens=1800,
                extra_body=LONG,
                extra_headers={"X-Request-Id": own_id},
            )
        except openai.APIStatusError as exc:
            result["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = cancel(gateway, own_id)
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    thread.join(60)
    error = result["error"]
    assert error.status_code == 499
    assert error.body["code"] == "cancelled"


def test_a_non_streaming_client_that_leaves_frees_all_its_choices(gateway: GatewayProc) -> None:
    body = {"model": "chat", "messages": MESSAGES, "max_tokens": 1800, "n": 2, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=1.0)
    wait_for(lambda: gateway.ps()["chat"]["in_flight"] == 0, what="both choices aborted")
    again = {"model": "chat", "messages": MESSAGES, "n": 2, "max_tokens": 2}
    r = post(gateway, "/v1/chat/completions", again)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_cancel_unknown_request(gateway: GatewayProc) -> None:
    r = cancel(gateway, "no-such-request")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
