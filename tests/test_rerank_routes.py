"""/v1/rerank's body and response: documents as strings or {"text"} objects, results most
relevant first, top_n and return_documents."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.api.relay import Choice
from gateway.api.rerank.routes import RerankFormatter, RerankRequest, rerank_request
from gateway.errors import GatewayError
from shared.types import CanonicalRequest, RequestOutput, Usage


def body(**fields: object) -> RerankRequest:
    raw = {"model": "m", "query": "q", "documents": ["a", {"text": "b"}], **fields}
    return msgspec.json.decode(json.dumps(raw), type=RerankRequest)


def test_documents_as_strings_or_text_objects() -> None:
    assert rerank_request(body()) == CanonicalRequest(query="q", documents=["a", "b"])
    with pytest.raises(GatewayError) as info:
        rerank_request(body(documents=[]))
    assert info.value.param == "documents"
    with pytest.raises(msgspec.ValidationError):
        body(documents=[{"text": "a", "title": "t"}])


def test_results_sorted_cut_and_with_documents_when_asked() -> None:
    choice = Choice(0)
    choice.add(RequestOutput("r", scores=[0.1, 0.9, 0.5]))
    docs = ["a", "b", "c"]
    out = json.loads(RerankFormatter(body(), docs).response([choice], Usage(12)))
    assert [r["index"] for r in out["results"]] == [1, 2, 0]
    assert out["results"][0] == {"index": 1, "relevance_score": 0.9}
    assert out["usage"] == {"prompt_tokens": 12, "total_tokens": 12} and out["model"] == "m"
    assert out["id"].startswith("rerank-")
    top = json.loads(
        RerankFormatter(body(top_n=2, return_documents=True), docs).response([choice], Usage(1))
    )
    assert top["results"] == [
        {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
        {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}},
    ]
