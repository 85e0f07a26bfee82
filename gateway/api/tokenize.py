"""/tokenize and /detokenize (vLLM's shapes): the model's own tokenizer, in its worker."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request, Response, post
from litestar.datastructures import State
from msgspec import Meta

from gateway.api.common import decode_body
from gateway.api.images import ImageLimits, images_in, resolve_images
from gateway.api.openai.messages import message_of
from gateway.api.openai.schemas import ChatMessage, ErrorBody
from gateway.api.openapi import documented
from gateway.api.serve import JSON
from gateway.edge.middleware import authorize_model, context_of
from gateway.errors import GatewayError
from gateway.workers.client import WorkerClient
from shared.types import CanonicalRequest, ErrorCode, RequestKind


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | bool | int | float] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    tokens: list[Annotated[int, Meta(ge=0, le=2**31 - 1)]]


class DetokenizeResponse(msgspec.Struct):
    prompt: str  # the tokens' text (vLLM's field name)


async def tokenize_prompt(
    state: State,
    request: Request[Any, Any, Any],
    model: str,
    kind: RequestKind,
    canonical: CanonicalRequest,
    with_text: bool = False,
) -> dict[str, Any]:
    """Template and tokenize as a generation request would be (the model's configured
    chat_template_kwargs included), without generating."""
    workers: WorkerClient = state.workers
    authorize_model(context_of(request.scope), model, lambda n: workers.resolve(n).name)
    if images_in(canonical):  # counted as the model sees them: fetched and checked first
        workers.check(model, ["vision"])
        canonical = await resolve_images(canonical, ImageLimits.of(state.config.server))
    return await workers.tokenize(model, kind, canonical, with_text)


@post(
    "/tokenize",
    status_code=200,
    operation_class=documented(
        ErrorBody,
        {JSON: TokenizeRequest},
        {JSON: TokenizeResponse},
        {
            "a prompt": {"model": "my-model", "prompt": "Hello!"},
            "a chat": {"model": "my-model", "messages": [{"role": "user", "content": "Hello!"}]},
        },
    ),
)
async def tokenize(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    body = decode_body(await request.body(), TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise GatewayError(
            ErrorCode.INVALID_REQUEST, "send exactly one of `prompt` and `messages`", "prompt"
        )
    if body.messages is not None:
        if not body.messages:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST, "`messages` must not be empty", "messages"
            )
        kind = RequestKind.CHAT
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        canonical = CanonicalRequest(
            messages=[message_of(i, m) for i, m in enumerate(body.messages)],
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            chat_template_kwargs=kwargs,
        )
    else:
        if not body.prompt:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "`prompt` must not be empty", "prompt")
        kind = RequestKind.COMPLETION
        canonical = CanonicalRequest(prompt=body.prompt)
    result = await tokenize_prompt(
        state, request, body.model, kind, canonical, body.return_token_strs
    )
    out = TokenizeResponse(
        result["count"], result["max_context"], result["tokens"], result.get("token_strs")
    )
    return Response(msgspec.json.encode(out), media_type=JSON)


@post(
    "/detokenize",
    status_code=200,
    operation_class=documented(
        ErrorBody,
        {JSON: DetokenizeRequest},
        {JSON: DetokenizeResponse},
        {"two tokens": {"model": "my-model", "tokens": [9906, 0]}},
    ),
)
async def detokenize(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    body = decode_body(await request.body(), DetokenizeRequest)
    workers: WorkerClient = state.workers
    authorize_model(context_of(request.scope), body.model, lambda n: workers.resolve(n).name)
    workers.check(body.model, ["tokenize"])
    result = await workers.call(body.model, "detokenize", {"tokens": body.tokens})
    return Response(msgspec.json.encode(DetokenizeResponse(result["text"])), media_type=JSON)
