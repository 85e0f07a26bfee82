"""Add frame -> an embedding request's token ids, with its limits (the input thread's)."""

from __future__ import annotations

from typing import Any

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import ErrorCode, RequestError, RequestKind
from worker.embeddings.encoder import Encoder
from worker.embeddings.engine import PreparedEmbedding
from worker.preprocess import PreprocessError

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)


MAX_DOCUMENTS = 1000  # documents in one rerank request (Cohere's limit)


class EmbeddingPreprocessor:
    """Embedding requests for an embedding model; rerank requests for a cross-encoder, or
    for an embedding model whose config allows reranking by similarity."""

    def __init__(
        self,
        encoder: Encoder,
        options: EngineOptions,
        similarity_rerank: bool = False,
        matryoshka: bool = False,
    ) -> None:
        self.encoder = encoder
        self.similarity_rerank = similarity_rerank
        self.matryoshka = matryoshka
        self.max_prompt_tokens = options.max_prompt_tokens  # the request's total
        # what the tokenizer's template puts around a text ([CLS] ... [SEP], <s> ... </s>):
        # token-array inputs get it too, as texts do
        around = encoder.tokenize([""])[0]
        self.head, self.tail = around[:1], around[1:]

    def __call__(self, frame: Add) -> PreparedEmbedding:
        if frame.kind == RequestKind.RERANK:
            return self._rerank(frame)
        if frame.kind != RequestKind.EMBEDDING or self.encoder.scores:
            served = "/v1/rerank" if self.encoder.scores else "/v1/embeddings"
            raise _invalid(f"this model serves {served}, not {frame.kind} requests", "model")
        request = frame.request
        if request.inputs and request.input_token_ids:
            raise _invalid("send texts or token arrays, not both", "input")
        if request.inputs:
            if any(not text for text in request.inputs):
                raise _invalid("an input is an empty string", "input")
            inputs = self.encoder.tokenize(request.inputs)
        else:
            inputs = [self._wrapped(i, ids) for i, ids in enumerate(request.input_token_ids)]
        if not inputs:
            raise _invalid("the request has no input", "input")
        if len(inputs) > MAX_INPUTS:
            raise _invalid(f"{len(inputs)} inputs; at most {MAX_INPUTS} a request", "input")
        limit = self.encoder.max_tokens
        for i, ids in enumerate(inputs):
            if len(ids) > limit:
                raise _invalid(
                    f"input[{i}] has {len(ids)} tokens; this model takes at most {limit}",
                    f"input[{i}]" if len(inputs) > 1 else "input",
                )
        self._check_total(inputs, "input")
        prepared = PreparedEmbedding(frame.request_id, inputs, frame.priority)
        prepared.dimensions = self._dimensions(request.dimensions)
        return prepared

    def _dimensions(self, wanted: int | None) -> int | None:
        size = self.encoder.dimensions
        if wanted is None or wanted == size:
            return None
        if not self.matryoshka:
            raise _invalid(
                f"this model's vectors have {size} dimensions and cannot be cut (a model "
                "trained for it, Matryoshka, can: matryoshka = true in its config)",
                "dimensions",
            )
        if not 1 <= wanted < size:
            raise _invalid(
                f"`dimensions` is {wanted}; this model's vectors have {size}", "dimensions"
            )
        return wanted

    def _rerank(self, frame: Add) -> PreparedEmbedding:
        request = frame.request
        if not self.encoder.scores and not self.similarity_rerank:
            raise _invalid(
                "this embedding model does not rerank (its config can allow it by similarity: "
                "similarity_rerank = true)",
                "model",
            )
        if not request.query:
            raise _invalid("`query` is empty", "query")
        docs = request.documents
        if not docs:
            raise _invalid("`documents` is empty", "documents")
        if len(docs) > MAX_DOCUMENTS:
            raise _invalid(f"{len(docs)} documents; at most {MAX_DOCUMENTS}", "documents")
        empty = next((i for i, d in enumerate(docs) if not d), None)
        if empty is not None:
            raise _invalid(f"documents[{empty}] is empty", f"documents[{empty}]")
        limit = self.encoder.max_tokens
        types: list[list[int]] | None = None
        if self.encoder.scores:
            inputs, types = self.encoder.pairs(request.query, docs)
            what = "with the query"
        else:
            inputs = self.encoder.tokenize([request.query, *docs])
            if len(inputs[0]) > limit:
                raise _invalid(
                    f"the query has {len(inputs[0])} tokens; this model takes at most {limit}",
                    "query",
                )
            what = ""
        first = 0 if self.encoder.scores else 1
        for i, ids in enumerate(inputs[first:]):
            if len(ids) > limit:
                raise _invalid(
                    f"documents[{i}] has {len(ids)} tokens{' ' + what if what else ''}; this "
                    f"model takes at most {limit}",
                    f"documents[{i}]",
                )
        self._check_total(inputs, "documents")
        return PreparedEmbedding(
            frame.request_id, inputs, frame.priority, kind=RequestKind.RERANK, types=types
        )

    def _check_total(self, inputs: list[list[int]], param: str) -> None:
        total = sum(len(ids) for ids in inputs)
        if self.max_prompt_tokens is not None and total > self.max_prompt_tokens:
            raise _invalid(
                f"the request has {total} tokens; this gateway accepts at most "
                f"{self.max_prompt_tokens} a request (max_prompt_tokens)",
                param,
            )

    def _wrapped(self, index: int, ids: list[int]) -> list[int]:
        if not ids:
            raise _invalid(f"input[{index}] is an empty token array", f"input[{index}]")
        vocab = self.encoder.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise _invalid(
                f"input[{index}] has token id {bad}, outside this model's vocabulary "
                f"(0..{vocab - 1})",
                f"input[{index}]",
            )
        return [*self.head, *ids, *self.tail]

    def tokenize_call(self, args: dict[str, Any]) -> dict[str, Any]:
        raise _invalid("an embedding model's worker does not tokenize on request", "model")

    detokenize_call = tokenize_call


def _invalid(message: str, param: str | None = None) -> PreprocessError:
    return PreprocessError(RequestError(ErrorCode.INVALID_REQUEST, message, param))
