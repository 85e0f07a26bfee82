"""OpenAI's /v1/embeddings: texts or token arrays in, one vector each out, as floats or as
base64 of their little-endian float32 bytes (what the openai SDK asks for by default)."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.response import Stream
from msgspec import Meta

from gateway.api.common import decode_body, invalid
from gateway.api.openai.schemas import ErrorBody
from gateway.api.openapi import documented
from gateway.api.relay import Choice, WholeBody
from gateway.api.serve import JSON, Job, Served, serve
from gateway.edge.logs import log_body
from gateway.edge.middleware import context_of
from shared.types import CanonicalRequest, RequestKind, SamplingParams, Usage

MAX_INPUTS = 2048  # OpenAI's limit on inputs a request
EXAMPLES = {"two texts": {"model": "my-embedder", "input": ["a cat", "a dog"]}}


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: str
    # a string, a list of strings, a token array, or a list of token arrays
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def embedding_request(body: EmbeddingRequest) -> CanonicalRequest:
    """The body's inputs as a canonical request; a 400 naming `input` for a shape OpenAI
    does not take (an empty list, mixed kinds, a non-integer token)."""
    request = _inputs(body.input)
    request.dimensions = body.dimensions  # the worker knows the model's size and config
    return request


def _inputs(value: str | list[Any]) -> CanonicalRequest:
    if isinstance(value, str):
        return CanonicalRequest(inputs=[value])
    if not value:
        raise invalid("`input` is an empty list", "input")
    if all(_token(v) for v in value):  # one input: its length is the model's to bound
        return CanonicalRequest(input_token_ids=[list(value)])
    if len(value) > MAX_INPUTS:
        raise invalid(f"`input` has {len(value)} items; at most {MAX_INPUTS}", "input")
    if all(isinstance(v, str) for v in value):
        return CanonicalRequest(inputs=list(value))
    if all(isinstance(v, list) and v and all(_token(t) for t in v) for v in value):
        return CanonicalRequest(input_token_ids=[list(v) for v in value])
    raise invalid(
        "`input` must be a string, a list of strings, a token array (non-negative "
        "integers) or a list of non-empty token arrays",
        "input",
    )


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


class EmbeddingFormatter(WholeBody):
    """The response body (embeddings are never streamed)."""

    def __init__(self, model: str, encoding_format: str) -> None:
        self.model = model
        self.base64 = encoding_format == "base64"

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        [choice] = choices
        vectors = np.frombuffer(choice.embeddings, dtype="<f4").reshape(-1, choice.dimensions)
        data = [
            EmbeddingData(i, base64.b64encode(v.tobytes()).decode() if self.base64 else v.tolist())
            for i, v in enumerate(vectors)
        ]
        tokens = usage.prompt_tokens
        return msgspec.json.encode(EmbeddingList(data, self.model, EmbeddingUsage(tokens, tokens)))


@post(
    "/embeddings",
    status_code=200,
    operation_class=documented(
        ErrorBody, {JSON: EmbeddingRequest}, {JSON: EmbeddingList}, EXAMPLES
    ),
)
async def embeddings(
    request: Request[Any, Any, Any], state: State
) -> Response[bytes] | Stream:  # a JSON body: `served` never streams
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, EmbeddingRequest)
    canonical = embedding_request(body)
    served = Served(
        body.model, RequestKind.EMBEDDING, [Job(canonical, SamplingParams())], user=body.user
    )
    response = await serve(
        request, state, served, EmbeddingFormatter(body.model, body.encoding_format)
    )
    assert isinstance(response, Response)  # never streamed
    return response
