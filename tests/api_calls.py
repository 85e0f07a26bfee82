"""What the end-to-end API tests share: a chat and a prompt to send, and calls to a
gateway's /tokenize and /detokenize routes."""

from __future__ import annotations

from typing import Any

import httpx

from tests.gateway_proc import GatewayProc

MESSAGES: Any = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT_TEXT = "The gateway starts one worker per model"


def post(gw: GatewayProc, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gw.base_url}{path}", json=body, timeout=60)


def tokenize(gw: GatewayProc, **body: Any) -> dict[str, Any]:
    r = post(gw, "/tokenize", body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def detokenize(gw: GatewayProc, model: str, tokens: list[int]) -> str:
    r = post(gw, "/detokenize", {"model": model, "tokens": tokens})
    assert r.status_code == 200, r.text
    text: str = r.json()["prompt"]
    return text


def chat_tokens(gw: GatewayProc, model: str = "chat", **body: Any) -> list[int]:
    tokens: list[int] = tokenize(gw, model=model, messages=MESSAGES, **body)["tokens"]
    return tokens
