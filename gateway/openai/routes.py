"""OpenAI-compatible routes: thin handlers over translate (pure) and relay (I/O)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.response import Stream

from gateway.context import RequestContext
from gateway.errors import GatewayError, error_response
from gateway.logs import log_body
from gateway.middleware import authorize_model, context_of
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
    keep_alive_of,
)
from gateway.relay import DONE, Formatter, Relay
from gateway.stream import RequestStream
from gateway.supervisor import Supervisor
from shared.types import CanonicalRequest, ErrorCode, Priority, RequestKind, SamplingParams

JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_S = 2.0  # SSE comment interval while a model loads for a streaming request


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
    keep_alive: float | None,
) -> Response[bytes] | Stream:
    supervisor: Supervisor = state.supervisor
    server = state.config.server
    timeout = server.request_timeout_s
    ctx = context_of(request_.scope)
    authorize_model(ctx, model, lambda name: supervisor.resolve(name).name)
    if ctx is not None:
        ctx.stream = stream
    request = (request[0], _capped(request[1], server.max_tokens_cap))
    submit_args = {
        "keep_alive": keep_alive,
        "request_id": ctx.request_id if ctx else None,
        "priority": priority_of(ctx),
    }
    if stream and supervisor.must_load(model):
        # The model loads first: answer at once and keep the connection alive meanwhile.
        submit = supervisor.submit(model, kind, *request, **submit_args)  # type: ignore[arg-type]
        return Stream(
            _load_then_relay(supervisor, model, submit, timeout, fmt, include_usage, ctx),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    handle = await supervisor.submit(model, kind, *request, **submit_args)  # type: ignore[arg-type]
    relay = Relay(supervisor, handle, timeout, request_.receive, ctx)
    if not stream:
        return Response(await relay.collect(fmt), media_type=JSON)
    first = await relay.first()
    relay.stop_watching()  # from here on, Litestar's Stream watches for the disconnect
    return Stream(
        relay.sse(fmt, first, include_usage, _error_event),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def _capped(sampling: SamplingParams, cap: int | None) -> SamplingParams:
    """server.max_tokens_cap: a request asking for more is refused, one asking for nothing
    gets the cap."""
    if cap is None:
        return sampling
    if sampling.max_tokens is None:
        return msgspec.structs.replace(sampling, max_tokens=cap)
    if sampling.max_tokens > cap:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"max_tokens is {sampling.max_tokens}; this gateway allows at most {cap} "
            "(server.max_tokens_cap)",
            "max_tokens",
        )
    return sampling


def priority_of(ctx: RequestContext | None) -> int:
    if ctx is None or ctx.key is None or ctx.key.priority == "interactive":
        return Priority.INTERACTIVE
    return Priority.BATCH


async def _load_then_relay(
    supervisor: Supervisor,
    model: str,
    submit: Coroutine[Any, Any, RequestStream],
    timeout: float,
    fmt: Formatter,
    include_usage: bool,
    ctx: RequestContext | None,
) -> AsyncIterator[bytes]:
    """SSE comments every KEEPALIVE_S while the model loads, then the usual stream; a
    failure to load is an error event (the status line has gone out)."""
    task = asyncio.ensure_future(submit)
    handed_over = False
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=KEEPALIVE_S)
            if not task.done():
                yield f": loading model {model}\n\n".encode()
        try:
            relay = Relay(supervisor, task.result(), timeout, ctx=ctx)
            first = await relay.first()
        except GatewayError as exc:
            yield b"data: " + _error_event(exc) + b"\n\n"
            yield DONE
            return
        handed_over = True
        async for chunk in relay.sse(fmt, first, include_usage, _error_event):
            yield chunk
    finally:
        if not task.done():
            task.cancel()
        elif not handed_over and not task.cancelled() and task.exception() is None:
            supervisor.abort(task.result())


@post("/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response[bytes] | Stream:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, ChatCompletionRequest)
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
        keep_alive_of(body),
    )


@post("/completions", status_code=200)
async def completions(request: Request, state: State) -> Response[bytes] | Stream:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, CompletionRequest)
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
        keep_alive_of(body),
    )


@get("/models")
async def list_models(state: State) -> Response[bytes]:
    supervisor: Supervisor = state.supervisor
    cards = []
    for name, model in supervisor.models.items():
        info = supervisor.worker_info(name)
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
