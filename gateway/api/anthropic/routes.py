"""Anthropic Messages API routes (/v1/messages, /v1/messages/count_tokens): thin handlers over
translate (pure) and serve (I/O). The headers x-api-key (read by the middleware),
anthropic-version and anthropic-beta are accepted whatever their value."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, post
from litestar.datastructures import State
from litestar.response import Stream

from gateway.api.anthropic.errors import error_response
from gateway.api.anthropic.formatter import count_tokens_body
from gateway.api.anthropic.schemas import (
    CountTokensBody,
    CountTokensRequest,
    ErrorBody,
    MessageBody,
    MessagesRequest,
)
from gateway.api.anthropic.translate import messages_formatter, messages_request, prompt_request
from gateway.api.common import decode_body
from gateway.api.openapi import SSE, documented
from gateway.api.serve import JSON, Job, Served, serve
from gateway.api.tokenize import tokenize_prompt
from gateway.edge.logs import log_body
from gateway.edge.middleware import context_of
from gateway.errors import GatewayError
from gateway.workers.client import WorkerClient
from shared.types import RequestKind

# Bodies each endpoint serves, shown in the OpenAPI document
HELLO = {"model": "my-model", "messages": [{"role": "user", "content": "Hello!"}]}
MESSAGES_EXAMPLES = {
    "a question": {**HELLO, "max_tokens": 64},
    "streamed": {**HELLO, "max_tokens": 64, "stream": True},
}


def model_thinks(state: State, name: str) -> bool:
    """The model's template has thinking (from its last Ready; unknown: no)."""
    workers: WorkerClient = state.workers
    try:
        view = workers.view(workers.resolve(name).name)
    except GatewayError:
        return False  # serve() answers the unknown model
    info = view.info or view.last_info
    return info is not None and "reasoning" in info.capabilities


@post(
    "/messages",
    status_code=200,
    operation_class=documented(
        ErrorBody, {JSON: MessagesRequest}, {JSON: MessageBody, SSE: None}, MESSAGES_EXAMPLES
    ),
)
async def create_message(request: Request[Any, Any, Any], state: State) -> Response[bytes] | Stream:
    raw = await request.body()
    ctx = context_of(request.scope)
    log_body(state.config.server.log_bodies, ctx, raw)
    body = decode_body(raw, MessagesRequest)
    canonical, sampling = messages_request(body, state.config.server.hosted_tools == "omit")
    user = body.metadata.user_id if body.metadata else None
    served = Served(
        body.model, RequestKind.CHAT, [Job(canonical, sampling)], stream=body.stream, user=user
    )
    formatter = messages_formatter(body, canonical, model_thinks(state, body.model))
    response = await serve(request, state, served, formatter)
    if ctx is not None:  # Anthropic's SDKs read it as the response's _request_id
        response.headers["request-id"] = ctx.request_id
    return response


@post(
    "/messages/count_tokens",
    status_code=200,
    operation_class=documented(
        ErrorBody, {JSON: CountTokensRequest}, {JSON: CountTokensBody}, {"a question": HELLO}
    ),
)
async def count_tokens(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, CountTokensRequest)
    canonical = prompt_request(body, state.config.server.hosted_tools == "omit")
    result = await tokenize_prompt(state, request, body.model, RequestKind.CHAT, canonical)
    return Response(count_tokens_body(result["count"]), media_type=JSON)


def anthropic_router() -> Router:
    return Router(
        path="/v1",
        route_handlers=[create_message, count_tokens],
        exception_handlers={GatewayError: error_response},
    )
