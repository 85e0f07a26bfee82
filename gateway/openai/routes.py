"""OpenAI-compatible routes: thin handlers over translate (pure) and relay (I/O)."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.response import Stream

from gateway.errors import GatewayError
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from gateway.openai.translate import (
    ChatFormatter,
    CompletionFormatter,
    chat_request,
    completion_request,
    decode_body,
    error_body,
)
from gateway.relay import Formatter, Relay
from gateway.supervisor import Supervisor
from shared.types import CanonicalRequest, RequestKind, SamplingParams

JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(_: Request, exc: GatewayError) -> Response[bytes]:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    return Response(
        msgspec.json.encode(error_body(exc)),
        status_code=exc.status,
        media_type=JSON,
        headers=headers,
    )


def _error_event(exc: GatewayError) -> bytes:
    return msgspec.json.encode(error_body(exc))


async def _serve(
    request_: Request,
    state: State,
    model: str,
    kind: RequestKind,
    request: tuple[CanonicalRequest, SamplingParams],
    fmt: Formatter,
    stream: bool,
    include_usage: bool,
) -> Response[bytes] | Stream:
    supervisor: Supervisor = state.supervisor
    handle = await supervisor.submit(model, kind, *request)
    relay = Relay(supervisor, handle, state.config.server.request_timeout_s, request_.receive)
    if not stream:
        return Response(await relay.collect(fmt), media_type=JSON)
    first = await relay.first()
    relay.stop_watching()  # from here on, Litestar's Stream watches for the disconnect
    return Stream(
        relay.sse(fmt, first, include_usage, _error_event),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@post("/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response[bytes] | Stream:
    body = decode_body(await request.body(), ChatCompletionRequest)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _serve(
        request,
        state,
        body.model,
        RequestKind.CHAT,
        chat_request(body),
        ChatFormatter(body.model),
        body.stream,
        include_usage,
    )


@post("/completions", status_code=200)
async def completions(request: Request, state: State) -> Response[bytes] | Stream:
    body = decode_body(await request.body(), CompletionRequest)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _serve(
        request,
        state,
        body.model,
        RequestKind.COMPLETION,
        completion_request(body),
        CompletionFormatter(body.model),
        body.stream,
        include_usage,
    )


@get("/models")
async def list_models(state: State) -> Response[bytes]:
    supervisor: Supervisor = state.supervisor
    cards = []
    for name, model in supervisor.models.items():
        handle = supervisor.workers.get(name)
        info = handle.info if handle else None
        demo = model.is_demo
        cards.append(
            ModelCard(
                id=name,
                created=int(state.started_at),
                owned_by="mlx-gateway",
                state=supervisor.state_of(name).value,
                aliases=list(model.aliases),
                description=(
                    "random-weight demo model: its output is gibberish by design" if demo else None
                ),
                max_context=info.capacity.max_context if info else None,
            )
        )
    return Response(msgspec.json.encode(ModelList(cards)), media_type=JSON)


def openai_router() -> Router:
    return Router(
        path="/v1",
        route_handlers=[chat_completions, completions, list_models],
        exception_handlers={GatewayError: error_response},
    )
