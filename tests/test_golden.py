"""Golden files: what a client receives, byte for byte, from each protocol, recorded so that a
change of layout is seen to change nothing on the wire (issue 20).

Each case sends one request over raw HTTP to a real gateway and compares the response (status,
content type, body, or each SSE event) with `tests/golden/<case>.txt`. What differs from one
run to the next is normalized first: ids keep their prefix (`chatcmpl-<id>`), times become 0.
The model is the "bytes" model, whose greedy chain is scripted (x -> y -> z -> x), so the text
is the same on every machine; the Responses API, which has no assistant prefill, runs on the
chat model with its generated text masked (`<text>`) and its structure kept. A stream's text
deltas are compared merged: how many tokens one event carries depends on timing (the gateway
coalesces what arrives while the client is behind), and so do Responses' sequence numbers.

    MLX_GATEWAY_GOLDEN=record pytest tests/test_golden.py   # rewrite the files (review the diff)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_proc import GatewayProc, running_gateway

GOLDEN = Path(__file__).parent / "golden"
RECORD = os.environ.get("MLX_GATEWAY_GOLDEN") == "record"
TIME_KEYS = {"created", "created_at", "completed_at"}
ID_KEYS = {"id", "item_id", "response_id", "system_fingerprint"}
TEXT_KEYS = {"text", "delta", "content"}  # masked in the loose cases only
ANTHROPIC = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
COUNT: list[dict[str, Any]] = [
    {"role": "user", "content": "Count."},
    {"role": "assistant", "content": "x"},
]
STRICT = {"temperature": 0}

# name: (path, body, headers, loose)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, str], bool]] = {
    "openai-chat": (
        "/v1/chat/completions",
        {
            "model": "bytes",
            "messages": COUNT,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 5,
            **STRICT,
        },
        {},
        False,
    ),
    "openai-completions": (
        "/v1/completions",
        {"model": "bytes", "prompt": "x", "max_tokens": 5, **STRICT},
        {},
        False,
    ),
    "openai-chat-unsupported": (
        "/v1/chat/completions",
        {"model": "bytes", "messages": COUNT, "functions": [{"name": "f"}]},
        {},
        False,
    ),
    "anthropic-messages": (
        "/v1/messages",
        {"model": "bytes", "messages": COUNT, "max_tokens": 5, **STRICT},
        ANTHROPIC,
        False,
    ),
    "anthropic-missing-max-tokens": (
        "/v1/messages",
        {"model": "bytes", "messages": COUNT},
        ANTHROPIC,
        False,
    ),
    "responses": (
        "/v1/responses",
        {"model": "chat", "input": "Tell me about the sea.", "max_output_tokens": 5, **STRICT},
        {},
        True,
    ),
    "responses-unknown-model": (
        "/v1/responses",
        {"model": "nobody", "input": "Hello"},
        {},
        False,
    ),
}


@pytest.fixture(scope="module")
def golden_gateway(chat_model: Path, bytes_model: Path) -> Iterator[GatewayProc]:
    """Its own gateway, prefix cache off: cached-token counts do not depend on which tests ran
    before."""
    models = [
        {"name": name, "source": str(path), "engine": {"prefix_cache": False}}
        for name, path in (("chat", chat_model), ("bytes", bytes_model))
    ]
    with running_gateway(models, request_timeout_s=60.0) as gw:
        yield gw


def _id(value: str) -> str:
    match = re.match(r"^([A-Za-z]+[-_])", value)
    return (match.group(1) if match else "") + "<id>"


def normalize(value: Any, loose: bool, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: normalize(v, loose, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, loose, key) for v in value]
    if key in TIME_KEYS and isinstance(value, (int, float)) and value:
        return 0
    if (key in ID_KEYS or key.endswith("_id")) and isinstance(value, str):
        return _id(value)
    if loose and key in TEXT_KEYS and isinstance(value, str) and value:
        return "<text>"
    return value


def _json_line(raw: str, loose: bool) -> str:
    data = json.loads(raw)
    # the gateway writes compact JSON: compare it as written, values normalized
    assert raw == json.dumps(data, separators=(",", ":"), ensure_ascii=False), raw
    return json.dumps(normalize(data, loose), separators=(",", ":"), ensure_ascii=False)


def _blank(value: Any, key: str = "") -> Any:
    """The event with its text emptied and its sequence number zeroed: its envelope."""
    if isinstance(value, dict):
        return {k: _blank(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v, key) for v in value]
    if key in TEXT_KEYS and isinstance(value, str):
        return ""
    return 0 if key == "sequence_number" else value


def _texts(value: Any, key: str = "") -> list[str]:
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _texts(v, k)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v, key)]
    return [value] if key in TEXT_KEYS and isinstance(value, str) and value else []


def _append_text(value: Any, more: str, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _append_text(v, more, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_append_text(v, more, key) for v in value]
    if key in TEXT_KEYS and isinstance(value, str) and value:
        return value + more
    return value


def _merge_deltas(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Consecutive events with one text each and the same envelope, as one event."""
    merged: list[tuple[str, Any]] = []
    for name, data in events:
        if merged and isinstance(data, dict) and isinstance(merged[-1][1], dict):
            last_name, last = merged[-1]
            texts, last_texts = _texts(data), _texts(last)
            if (
                name == last_name
                and len(texts) == len(last_texts) == 1
                and _blank(data) == _blank(last)
            ):
                merged[-1] = (name, _append_text(last, texts[0]))
                continue
        merged.append((name, data))
    for n, (_, data) in enumerate(merged):
        if isinstance(data, dict) and "sequence_number" in data:
            data["sequence_number"] = n
    return merged


def transcript(response: httpx.Response, loose: bool) -> str:
    kind = response.headers.get("content-type", "")
    head = f"{response.status_code} {kind}\n"
    body = response.read().decode()
    if not kind.startswith("text/event-stream"):
        return head + _json_line(body, loose) + "\n"
    assert body.endswith("\n\n"), body[-200:]
    events: list[tuple[str, Any]] = []
    for block in body[:-2].split("\n\n"):
        lines = block.split("\n")
        name = lines[0] if lines[0].startswith("event: ") else ""
        assert lines[-1].startswith("data: ") and len(lines) == (2 if name else 1), block
        data = lines[-1][6:]
        events.append((name, data if data == "[DONE]" else json.loads(_json_line(data, False))))
    out = []
    for name, data in _merge_deltas(events):
        line = "data: " + (
            data
            if isinstance(data, str)
            else json.dumps(normalize(data, loose), separators=(",", ":"), ensure_ascii=False)
        )
        out.append(f"{name}\n{line}" if name else line)
    return head + "\n\n".join(out) + "\n\n"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_wire_is_as_recorded(golden_gateway: GatewayProc, case: str, stream: bool) -> None:
    path, body, headers, loose = CASES[case]
    body = {**body, "stream": stream}
    if stream and path == "/v1/chat/completions":
        body["stream_options"] = {"include_usage": True}
    with httpx.stream(
        "POST", golden_gateway.base_url + path, json=body, headers=headers, timeout=60
    ) as response:
        got = transcript(response, loose)
    file = GOLDEN / f"{case}-{'sse' if stream else 'json'}.txt"
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        file.write_text(got)
    assert file.exists(), f"no golden file {file.name}: record with MLX_GATEWAY_GOLDEN=record"
    assert got == file.read_text()
