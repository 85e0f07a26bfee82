"""/v1/rerank and /v2/rerank in the shape of Cohere's and Jina's rerank APIs (as vLLM and
Infinity serve them): a query and documents in, the documents' indices and relevance scores
out, most relevant first. Errors have OpenAI's shape, as the rest of /v1."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, Router, post
from litestar.datastructures import State
from litestar.response import Stream
from msgspec import Meta

from gateway.api.common import decode_body, invalid
from gateway.api.openai.errors import error_response
from gateway.api.openai.schemas import ErrorBody
from gateway.api.openapi import documented
from gateway.api.relay import Choice, WholeBody
from gateway.api.serve import JSON, Job, Served, serve
from gateway.edge.logs import log_body
from gateway.edge.middleware import context_of
from gateway.errors import GatewayError
from shared.types import CanonicalRequest, RequestKind, SamplingParams, Usage

MAX_DOCUMENTS = 1000
EXAMPLES = {
    "three documents": {
        "model": "my-reranker",
        "query": "What is a cat?",
        "documents": ["A cat is a small feline.", "Dogs bark.", "Cats purr."],
        "top_n": 2,
    }
}


class TextDocument(msgspec.Struct, forbid_unknown_fields=True):
    text: str


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: str
    query: str
    documents: list[str | TextDocument]
    top_n: Annotated[int, Meta(ge=1)] | None = None
    return_documents: bool = False  # Cohere's default (Jina's is true: send it)


class ResultDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: ResultDocument | None = None


class RerankUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def rerank_request(body: RerankRequest) -> CanonicalRequest:
    if not body.documents:
        raise invalid("`documents` is empty", "documents")
    if len(body.documents) > MAX_DOCUMENTS:
        raise invalid(
            f"`documents` has {len(body.documents)} items; at most {MAX_DOCUMENTS}", "documents"
        )
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    return CanonicalRequest(query=body.query, documents=texts)


class RerankFormatter(WholeBody):
    """The response body (rerank is never streamed)."""

    def __init__(self, body: RerankRequest, documents: list[str]) -> None:
        self.body = body
        self.documents = documents

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        [choice] = choices
        order = sorted(range(len(choice.scores)), key=lambda i: -choice.scores[i])
        if self.body.top_n is not None:
            order = order[: self.body.top_n]
        results = [
            RerankResult(
                i,
                choice.scores[i],
                ResultDocument(self.documents[i]) if self.body.return_documents else None,
            )
            for i in order
        ]
        tokens = usage.prompt_tokens
        body = RerankResponse(
            f"rerank-{uuid.uuid4().hex}", self.body.model, results, RerankUsage(tokens, tokens)
        )
        return msgspec.json.encode(body)


@post(
    ["/v1/rerank", "/v2/rerank", "/rerank"],
    status_code=200,
    operation_class=documented(ErrorBody, {JSON: RerankRequest}, {JSON: RerankResponse}, EXAMPLES),
)
async def rerank(request: Request[Any, Any, Any], state: State) -> Response[bytes] | Stream:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, RerankRequest)
    canonical = rerank_request(body)
    served = Served(body.model, RequestKind.RERANK, [Job(canonical, SamplingParams())])
    return await serve(request, state, served, RerankFormatter(body, canonical.documents))


def rerank_router() -> Router:
    return Router(
        path="/", route_handlers=[rerank], exception_handlers={GatewayError: error_response}
    )
