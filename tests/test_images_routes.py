"""Images through each protocol's route, in process (a scripted worker client): a model that
takes no images is refused before anything is fetched; a vision model's images reach its
worker as checked bytes; a bad image is a 400 in the protocol's own error shape, naming
the image's field."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from litestar import Litestar
from litestar.datastructures import State
from PIL import Image

from gateway.api.anthropic.routes import anthropic_router
from gateway.api.openai.routes import openai_router
from gateway.api.responses.routes import responses_router
from gateway.api.serve import InFlight
from gateway.errors import GatewayError
from gateway.workers.capabilities import MISSING_PARAM, missing_reason
from gateway.workers.client import RequestStream, Submission
from shared.config import Config, ServerConfig
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    ImagePart,
    RequestKind,
    RequestOutput,
    Usage,
)


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (2, 2), "blue").save(out, "PNG")
    return out.getvalue()


PNG = _png()
DATA_URL = f"data:image/jpeg;base64,{base64.b64encode(PNG).decode()}"  # typed wrong on purpose
CLOSED = "http://127.0.0.1:9/cat.png"  # nothing listens there (the discard port)


class Workers:
    """Two models: "vision" takes images, "text" does not (the capability check's 400)."""

    def __init__(self) -> None:
        self.requests: list[CanonicalRequest] = []

    def resolve(self, name: str) -> Any:
        if name not in ("vision", "text"):
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no model {name!r}", "model")
        return SimpleNamespace(name=name)

    def must_load(self, name: str) -> bool:
        return False

    def view(self, name: str) -> Any:
        return SimpleNamespace(info=None, last_info=None)

    def check(self, name: str, needs: Sequence[str]) -> None:
        if name == "text" and "vision" in needs:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                f"model {name!r} cannot serve this request: {missing_reason('vision')}",
                MISSING_PARAM["vision"],
            )

    async def submit(self, submission: Submission) -> RequestStream:
        self.check(submission.model, submission.needs)
        self.requests.append(submission.request)
        stream = RequestStream(submission.request_id or "r", submission.model, "w")
        done = RequestOutput("r", "ok", [1], FinishReason.STOP, usage=Usage(1, 1))
        asyncio.get_running_loop().call_soon(stream.put, done)
        return stream

    def abort(self, stream: RequestStream) -> None:
        pass

    async def tokenize(
        self, name: str, kind: RequestKind, request: CanonicalRequest, with_text: bool = False
    ) -> dict[str, Any]:
        self.requests.append(request)
        return {"count": 7, "max_context": 64, "tokens": [1] * 7}


@dataclass(frozen=True)
class Protocol:
    path: str
    body: Callable[[str, str], dict[str, Any]]  # (model, image URL) -> request body
    where: str  # the image's field in that body
    error: Callable[[dict[str, Any]], tuple[str, str | None]]  # body -> (message, param)


def _openai_error(body: dict[str, Any]) -> tuple[str, str | None]:
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    return error["message"], error["param"]


def _anthropic_error(body: dict[str, Any]) -> tuple[str, str | None]:
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"], None  # Anthropic's errors name no field


def _chat(model: str, url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def _messages(model: str, url: str) -> dict[str, Any]:
    image = {"type": "image", "source": {"type": "url", "url": url}}
    messages = [{"role": "user", "content": [image]}]
    return {"model": model, "max_tokens": 2, "system": "S", "messages": messages}


def _responses(model: str, url: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": url}]
    return {"model": model, "input": [{"role": "user", "content": content}]}


PROTOCOLS = {
    "openai": Protocol(
        "/v1/chat/completions", _chat, "messages[0].content[1].image_url.url", _openai_error
    ),
    "anthropic": Protocol(
        "/v1/messages", _messages, "messages[0].content[0].source", _anthropic_error
    ),
    "responses": Protocol(
        "/v1/responses", _responses, "input[0].content[1].image_url", _openai_error
    ),
}


def _app(workers: Workers, **server: Any) -> Any:
    state = State(
        {
            "config": Config(server=ServerConfig(**server)),
            "workers": workers,
            "inflight": InFlight(),
            "finish_hooks": [],
        }
    )
    routers = [openai_router(), anthropic_router(), responses_router()]
    return Litestar(route_handlers=routers, state=state)


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[Workers, Callable[..., httpx.AsyncClient]]]:
    workers = Workers()
    clients: list[httpx.AsyncClient] = []

    def client(**server: Any) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=_app(workers, **server))
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://localhost"))
        return clients[-1]

    yield workers, client
    for each in clients:
        await each.aclose()


Gateway = tuple[Workers, Callable[..., httpx.AsyncClient]]


@pytest.mark.anyio
@pytest.mark.parametrize("name", PROTOCOLS)
async def test_a_text_model_refuses_images_before_any_fetch(gateway: Gateway, name: str) -> None:
    """The URL would fail to fetch (nothing listens): the capability's 400 comes first."""
    workers, client = gateway
    protocol = PROTOCOLS[name]
    r = await client(image_fetch_private=True).post(
        protocol.path, json=protocol.body("text", CLOSED)
    )
    assert r.status_code == 400, r.text
    message, param = protocol.error(r.json())
    assert "model 'text' cannot serve this request: it takes no images" in message
    assert param in (None, "messages" if name == "openai" else "input")
    assert workers.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize("name", PROTOCOLS)
async def test_a_vision_model_gets_checked_bytes(gateway: Gateway, name: str) -> None:
    workers, client = gateway
    protocol = PROTOCOLS[name]
    r = await client().post(protocol.path, json=protocol.body("vision", DATA_URL))
    assert r.status_code == 200, r.text
    [request] = workers.requests
    images = [part for m in request.messages for part in m.parts if isinstance(part, ImagePart)]
    assert [(i.data, i.media_type, i.url, i.where) for i in images] == [
        (PNG, "image/png", None, protocol.where)
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("name", PROTOCOLS)
@pytest.mark.parametrize(
    ("url", "server", "why"),
    [
        (CLOSED, {}, "127.0.0.1, a private, loopback, link-local"),
        (CLOSED, {"image_fetch_private": True}, "could not fetch http://127.0.0.1:9/cat.png"),
        ("data:image/png;base64,aGVsbG8=", {}, "not a readable image"),
        (DATA_URL, {"image_max_pixels": 3}, "2x2: more than 3 pixels"),
    ],
)
async def test_a_bad_image_is_a_400_in_the_protocols_shape_naming_it(
    gateway: Gateway, name: str, url: str, server: dict[str, Any], why: str
) -> None:
    workers, client = gateway
    protocol = PROTOCOLS[name]
    r = await client(**server).post(protocol.path, json=protocol.body("vision", url))
    assert r.status_code == 400, r.text
    message, param = protocol.error(r.json())
    assert message.startswith(f"`{protocol.where}`: ") and why in message
    assert param in (None, protocol.where)
    assert workers.requests == []


@pytest.mark.anyio
async def test_a_streamed_request_is_refused_with_a_plain_400(gateway: Gateway) -> None:
    """Images are ready before the stream starts: a bad one is the HTTP error, no event."""
    _, client = gateway
    body = {**_chat("vision", "data:image/png;base64,aGVsbG8="), "stream": True}
    r = await client().post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == PROTOCOLS["openai"].where


@pytest.mark.anyio
async def test_a_chained_response_sends_the_earlier_images_again(gateway: Gateway) -> None:
    workers, client = gateway
    gw = client()
    first = await gw.post("/v1/responses", json=_responses("vision", DATA_URL))
    assert first.status_code == 200, first.text
    items = await gw.get(f"/v1/responses/{first.json()['id']}/input_items")
    content = items.json()["data"][0]["content"]
    assert content[1] == {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}
    body = {"model": "vision", "input": "and now?", "previous_response_id": first.json()["id"]}
    second = await gw.post("/v1/responses", json=body)
    assert second.status_code == 200, second.text
    image = workers.requests[1].messages[0].parts[1]
    assert isinstance(image, ImagePart)
    assert (image.data, image.media_type, image.where) == (PNG, "image/png", "previous_response_id")


@pytest.mark.anyio
async def test_counted_tokens_see_the_images_checked(gateway: Gateway) -> None:
    """Anthropic's count_tokens (and /tokenize) template the images as a request would."""
    workers, client = gateway
    gw = client()

    def count(model: str, url: str) -> dict[str, Any]:
        return {key: value for key, value in _messages(model, url).items() if key != "max_tokens"}

    r = await gw.post("/v1/messages/count_tokens", json=count("vision", DATA_URL))
    assert r.status_code == 200 and r.json() == {"input_tokens": 7}
    image = workers.requests[0].messages[1].parts[0]
    assert isinstance(image, ImagePart) and (image.data, image.media_type) == (PNG, "image/png")
    r = await gw.post("/v1/messages/count_tokens", json=count("vision", CLOSED))
    assert r.status_code == 400 and "image_fetch_private" in _anthropic_error(r.json())[0]
    r = await gw.post("/v1/messages/count_tokens", json=count("text", DATA_URL))
    assert r.status_code == 400 and "takes no images" in _anthropic_error(r.json())[0]
