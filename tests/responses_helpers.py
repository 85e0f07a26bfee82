"""Helpers for the Responses API's tests without worker processes: a request body, the
events of a stream, worker outputs, a fake clock and API keys, a scripted supervisor and the
routes in process over it, and the official openai SDK's types to check bodies and events
against."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import openai.types.responses as sdk
from litestar import Litestar
from litestar.datastructures import State
from pydantic import TypeAdapter

from gateway.api.common import decode_body
from gateway.api.responses.routes import responses_router
from gateway.api.responses.schemas import ResponsesRequest
from gateway.api.serve import InFlight
from gateway.edge.context import RequestContext, new_request_id
from gateway.edge.keys import ApiKey
from gateway.edge.middleware import CONTEXT_KEY
from gateway.errors import GatewayError
from gateway.workers.client import RequestStream, Submission
from shared.config import Config, ServerConfig
from shared.types import CanonicalRequest, ErrorCode, FinishReason, RequestOutput, Usage


def _request(**fields: Any) -> ResponsesRequest:
    return decode_body(
        json.dumps({"model": "m", "input": "hi", **fields}).encode(), ResponsesRequest
    )


def _parse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        events.append((name_line[7:], json.loads(data_line[6:])))
    return events


def _out(text: str, ids: list[int], finish: FinishReason | None = None, **kw: Any) -> RequestOutput:
    return RequestOutput("r", text=text, token_ids=ids, finish_reason=finish, **kw)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(key_id: str, scope: str = "inference") -> ApiKey:
    return ApiKey(id=key_id, name=key_id, hash="0" * 64, created_at=0.0, scope=scope)  # type: ignore[arg-type]


class ScriptedWorkers:
    """Stands in for the workers' client: each request answers "Hello" in two deltas (prompt
    tokens = the number of messages, `cached` of them from the prefix cache), or, with
    `hold`, one delta and then nothing."""

    def __init__(self) -> None:
        self.hold = False
        self.cached = 0
        self.requests: list[CanonicalRequest] = []
        self.aborted: list[str] = []

    def resolve(self, name: str) -> Any:
        if name != "m":
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no model {name!r}", "model")
        return SimpleNamespace(name=name)

    def must_load(self, name: str) -> bool:
        return False

    async def submit(self, submission: Submission) -> RequestStream:
        request = submission.request
        self.requests.append(request)
        rid = submission.request_id or new_request_id()
        stream = RequestStream(rid, submission.model, "w")
        prompt = len(request.messages)
        loop = asyncio.get_running_loop()
        cached = min(self.cached, prompt)
        loop.call_soon(stream.put, _out("Hel", [1], usage=Usage(prompt, 0, cached)))
        if not self.hold:
            last = _out("lo", [2], FinishReason.STOP, usage=Usage(prompt, 2, cached))
            loop.call_later(0.01, stream.put, last)
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.aborted.append(stream.request_id)


KEYS = {"k1": _key("k1"), "k2": _key("k2"), "boss": _key("boss", "admin")}


def _app(workers: ScriptedWorkers, **server: Any) -> Callable[..., Any]:
    state = State(
        {
            "config": Config(server=ServerConfig(**server)),
            "workers": workers,
            "inflight": InFlight(),
            "finish_hooks": [],
        }
    )
    litestar = Litestar(route_handlers=[responses_router()], state=state)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        """As the gateway's middleware does: a context with the caller's key (if any)."""
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            key = KEYS.get(headers.get(b"x-api-key", b"").decode())
            ctx = RequestContext(new_request_id(), scope["method"], scope["path"], key=key)
            scope[CONTEXT_KEY] = ctx
        await litestar(scope, receive, send)

    app.state = state  # type: ignore[attr-defined]
    return app


_EVENT = TypeAdapter(sdk.ResponseStreamEvent)
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _strict(value: Any, key: str = "") -> Any:
    """A body as the SDK's strict validation wants it. Its client reads bodies leniently;
    `model_validate` also wants one of OpenAI's own error codes in a failed response (the
    gateway's codes are its own)."""
    if isinstance(value, list):
        return [_strict(v) for v in value]
    if not isinstance(value, dict):
        return value
    value = {k: _strict(v, k) for k, v in value.items()}
    if key == "response" and isinstance(value.get("error"), dict):
        value["error"] = {**value["error"], "code": "server_error"}
    return value


def _event(data: dict[str, Any]) -> Any:
    return _EVENT.validate_python(_strict(data))


def _response(body: bytes | dict[str, Any]) -> sdk.Response:
    data = json.loads(body) if isinstance(body, bytes) else body
    return sdk.Response.model_validate(_strict(data, "response"))
