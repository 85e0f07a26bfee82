"""OpenAI-compatible routes: thin handlers over translate (pure) and relay (I/O)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.params import FromPath
from litestar.response import Stream

from gateway.api.common import decode_body
from gateway.api.openai.embeddings import embeddings
from gateway.api.openai.errors import error_response
from gateway.api.openai.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
    RequestCancelled,
)
from gateway.api.openai.translate import (
    ChatFormatter,
    CompletionFormatter,
    chat_request,
    completion_request,
    keep_alive_of,
)
from gateway.api.openapi import SSE, documented
from gateway.api.serve import JSON, InFlight, Job, Served, serve
from gateway.edge.logs import log_body
from gateway.edge.middleware import authorize_model, context_of, may_use
from gateway.errors import GatewayError
from gateway.workers.client import WorkerClient
from shared.modelinfo import kind_served, peek
from shared.types import RequestKind

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Bodies each endpoint serves, shown in the OpenAPI document
HELLO = [{"role": "user", "content": "Hello!"}]
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}
CHAT_EXAMPLES = {
    "a question": {"model": "my-model", "messages": HELLO, "max_tokens": 64},
    "streamed": {"model": "my-model", "messages": HELLO, **STREAMED},
}
COMPLETION_EXAMPLES = {
    "a prompt": {"model": "my-model", "prompt": "Once upon a time", "max_tokens": 32},
    "streamed": {"model": "my-model", "prompt": "Once upon a time", **STREAMED},
}


@post(
    "/chat/completions",
    status_code=200,
    operation_class=documented(
        ErrorBody,
        {JSON: ChatCompletionRequest},
        {JSON: ChatCompletion, SSE: None},
        CHAT_EXAMPLES,
    ),
)
async def chat_completions(
    request: Request[Any, Any, Any], state: State
) -> Response[bytes] | Stream:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, ChatCompletionRequest)
    canonical, sampling = chat_request(body)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    served = Served(
        body.model,
        RequestKind.CHAT,
        [Job(canonical, sampling)],
        n=body.n,
        stream=body.stream,
        keep_alive=keep_alive_of(body),
        user=body.user or body.safety_identifier,
    )
    fmt = ChatFormatter(body.model, body.n, include_usage, body.logprobs)
    return await serve(request, state, served, fmt)


@post(
    "/completions",
    status_code=200,
    operation_class=documented(
        ErrorBody, {JSON: CompletionRequest}, {JSON: Completion, SSE: None}, COMPLETION_EXAMPLES
    ),
)
async def completions(request: Request[Any, Any, Any], state: State) -> Response[bytes] | Stream:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, CompletionRequest)
    jobs = [Job(c, s) for c, s in completion_request(body)]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    served = Served(
        body.model,
        RequestKind.COMPLETION,
        jobs,
        n=body.n,
        stream=body.stream,
        keep_alive=keep_alive_of(body),
        default_max_tokens=COMPLETION_MAX_TOKENS,
        user=body.user or body.safety_identifier,
    )
    prompts = [job.request.prompt for job in jobs for _ in range(body.n)]
    fmt = CompletionFormatter(body.model, prompts, include_usage, body.echo, body.logprobs)
    return await serve(request, state, served, fmt)


def model_card(state: State, name: str) -> ModelCard:
    workers: WorkerClient = state.workers
    model = workers.resolve(name)
    view = workers.view(model.name)
    info = view.info or view.last_info
    context: int | None
    capabilities: list[str] | None
    if info is not None:
        # 0: a model with no token context (speech: audio has limits of its own)
        context, capabilities = info.capacity.max_context or None, list(info.capabilities)
    else:  # not loaded yet: what its files say (None for a hub id not downloaded)
        context, capabilities = peek(model)
    return ModelCard(
        id=name,
        created=int(state.started_at),
        owned_by="mlx-gateway",
        state=view.state.value,
        aliases=list(model.aliases),
        description=(
            "random-weight demo model: its output is gibberish by design" if model.is_demo else None
        ),
        max_context=context,
        context_length=context,
        capabilities=capabilities,
        kind=kind_served(model, info.capabilities if info else None).value,
    )


@get("/models", operation_class=documented(ErrorBody, replies={JSON: ModelList}))
async def list_models(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    """The models the caller's key may use (every model on an open gateway)."""
    workers: WorkerClient = state.workers
    key = getattr(context_of(request.scope), "key", None)

    def canonical(name: str) -> str:
        return workers.resolve(name).name

    names = [name for name in workers.models if may_use(key, name, canonical)]
    cards = [model_card(state, name) for name in names]
    return Response(msgspec.json.encode(ModelList(cards)), media_type=JSON)


@get(
    "/models/{model_id:path}",
    operation_class=documented(ErrorBody, replies={JSON: ModelCard}),
)
async def get_model(
    request: Request[Any, Any, Any], state: State, model_id: FromPath[str]
) -> Response[bytes]:
    name = model_id.lstrip("/")
    workers: WorkerClient = state.workers
    workers.resolve(name)  # 404 model_not_found in OpenAI's shape
    authorize_model(context_of(request.scope), name, lambda n: workers.resolve(n).name)
    return Response(msgspec.json.encode(model_card(state, name)), media_type=JSON)


@post(
    "/requests/{request_id:str}/cancel",
    status_code=200,
    operation_class=documented(ErrorBody, replies={JSON: RequestCancelled}),
)
async def cancel_request(
    request: Request[Any, Any, Any], state: State, request_id: FromPath[str]
) -> Response[bytes]:
    """Abort a request in flight from another connection (its own key or an admin key)."""
    inflight: InFlight = state.inflight
    cancelled = inflight.cancel(state.workers, request_id, context_of(request.scope))
    body = RequestCancelled(request_id, cancelled)
    return Response(msgspec.json.encode(body), media_type=JSON)


def openai_router() -> Router:
    return Router(
        path="/v1",
        route_handlers=[
            chat_completions,
            completions,
            embeddings,
            list_models,
            get_model,
            cancel_request,
        ],
        exception_handlers={GatewayError: error_response},
    )
