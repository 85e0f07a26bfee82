"""The embedding worker's engine: the inputs of every waiting request in one queue, encoded a
batch at a time (rows from several requests side by side), each request answered whole once
all its inputs are. Interactive requests go before batch ones; within a priority, first come
first served. The same interface as the text engine, for the worker process around it."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from shared.config import EngineOptions
from shared.types import (
    FinishReason,
    Priority,
    RequestKind,
    RequestOutput,
    Timings,
    Usage,
)
from worker.embeddings.encoder import Encoder


@dataclass(slots=True)
class PreparedEmbedding:
    """An embedding request's inputs, or a rerank request's: the query then each document
    (by similarity), or each (query, document) pair (a cross-encoder, with token types)."""

    request_id: str
    inputs: list[list[int]]  # token ids of each input, special tokens included
    priority: int = 0
    received_at: float = 0.0
    prepared_at: float = 0.0
    kind: RequestKind = RequestKind.EMBEDDING
    types: list[list[int]] | None = None  # token types of each input (pairs)
    dimensions: int | None = None  # vectors cut to their first components (Matryoshka)

    @property
    def prompt(self) -> list[int]:  # what the worker logs of a request
        return [t for ids in self.inputs for t in ids]


@dataclass(slots=True, eq=False)
class _Pending:
    request: PreparedEmbedding
    vectors: np.ndarray  # (inputs, dimensions), filled as batches finish
    left: int  # inputs not encoded yet
    started_at: float = 0.0  # perf_counter of its first batch


@dataclass(slots=True)
class _Backend:
    """What the worker process reads of a backend."""

    device: str
    batcher: str = "embeddings"

    def release_memory(self) -> None:
        mx.clear_cache()


class EmbeddingEngine:
    def __init__(self, encoder: Encoder, options: EngineOptions) -> None:
        self.encoder = encoder
        self.max_rows = max(1, options.max_running)  # inputs encoded side by side
        self.max_batch_tokens = max(encoder.max_tokens, options.max_prefill_tokens)
        self.pending: dict[str, _Pending] = {}
        # (request id, input index) in arrival order, one queue per priority
        self.queues: dict[int, deque[tuple[str, int]]] = {p: deque() for p in Priority}
        self.steps = 0
        self.backend = _Backend("cpu" if mx.default_device() == mx.cpu else "gpu")
        self.prefix_cache = None

    # ---- the worker's interface -------------------------------------------------------

    def add(self, prepared: PreparedEmbedding) -> RequestOutput | None:
        if not prepared.inputs:
            raise ValueError("the request has no input")
        if prepared.request_id in self.pending:
            raise ValueError(f"request {prepared.request_id} is already running")
        vectors = np.zeros((len(prepared.inputs), self.encoder.dimensions), dtype=np.float32)
        self.pending[prepared.request_id] = _Pending(prepared, vectors, len(prepared.inputs))
        queue = self.queues[min(max(prepared.priority, 0), Priority.BATCH)]
        queue.extend((prepared.request_id, i) for i in range(len(prepared.inputs)))
        return None

    @property
    def has_work(self) -> bool:
        return any(self.queues.values())

    can_step = has_work  # (nothing of theirs waits on another thread)

    def step(self) -> list[RequestOutput]:
        """One batch through the encoder; the requests it completed."""
        self.steps += 1
        batch = self._take()
        if not batch:
            return []
        now = time.perf_counter()
        for rid, _ in batch:
            pending = self.pending[rid]
            pending.started_at = pending.started_at or now
        requests = [self.pending[rid].request for rid, _ in batch]
        ids = [r.inputs[i] for r, (_, i) in zip(requests, batch, strict=True)]
        types = None
        if any(r.types is not None for r in requests):
            types = [
                r.types[i] if r.types is not None else [0] * len(r.inputs[i])
                for r, (_, i) in zip(requests, batch, strict=True)
            ]
        vectors = self.encoder.embed(ids, types)
        outputs = []
        for (rid, i), vector in zip(batch, vectors, strict=True):
            pending = self.pending[rid]
            pending.vectors[i] = vector
            pending.left -= 1
            if pending.left == 0:
                outputs.append(self._finish(pending))
        return outputs

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        gone = {rid for rid in request_ids if rid in self.pending}
        if not gone:
            return []
        for priority, queue in self.queues.items():
            self.queues[priority] = deque(item for item in queue if item[0] not in gone)
        outputs = []
        for rid in request_ids:
            if self.pending.pop(rid, None) is not None:
                outputs.append(RequestOutput(rid, finish_reason=FinishReason.ABORT))
        return outputs

    def request_ids(self) -> list[str]:
        return list(self.pending)

    def counts(self) -> tuple[int, int]:
        """(requests being encoded, requests none of whose inputs has started)."""
        # read by the output and input threads while the engine's adds and removes: a copy
        waiting = sum(1 for p in list(self.pending.values()) if not p.started_at)
        return max(len(self.pending) - waiting, 0), waiting

    def prefix_stats(self) -> None:
        return None

    def settle(self) -> None:
        """Nothing a step puts off here."""

    def probe(self) -> None:
        """Ready means ready: one input through the encoder, a finite unit-scale vector."""
        if self.encoder.scores:
            ids, types = self.encoder.pairs("Hi", ["Hello"])
            vector = self.encoder.embed(ids, types)[0]
        else:
            vector = self.encoder.embed(self.encoder.tokenize(["Hi"]))[0]
        if not np.isfinite(vector).all() or not vector.any():
            raise RuntimeError("the probe's embedding is not finite")

    # ---- batches ----------------------------------------------------------------------

    def _take(self) -> list[tuple[str, int]]:
        """The next inputs, at most max_rows of them and max_batch_tokens once padded to
        the longest; the first always goes."""
        batch: list[tuple[str, int]] = []
        longest = 0
        for priority in sorted(self.queues):
            items = self.queues[priority]
            while items and len(batch) < self.max_rows:
                rid, i = items[0]
                size = len(self.pending[rid].request.inputs[i])
                wider = max(longest, size)
                if batch and wider * (len(batch) + 1) > self.max_batch_tokens:
                    return batch
                batch.append(items.popleft())
                longest = wider
        return batch

    def _finish(self, pending: _Pending) -> RequestOutput:
        request = pending.request
        del self.pending[request.request_id]
        tokens = sum(len(ids) for ids in request.inputs)
        now = time.perf_counter()
        received = request.received_at or now
        timings = Timings(
            (request.prepared_at or received) - received,
            pending.started_at - (request.prepared_at or received),
            now - pending.started_at,
        )
        output = RequestOutput(
            request.request_id,
            finish_reason=FinishReason.STOP,
            usage=Usage(prompt_tokens=tokens),
            timings=timings,
        )
        if request.kind is RequestKind.RERANK:
            output.scores = [float(s) for s in self._scores(pending.vectors)]
        else:
            vectors = pending.vectors
            if request.dimensions is not None and request.dimensions < vectors.shape[1]:
                vectors = vectors[:, : request.dimensions]
                if self.encoder.pooling.normalize:
                    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
                    vectors = vectors / np.maximum(norms, 1e-12)
            output.embeddings = vectors.astype("<f4").tobytes()
            output.dimensions = vectors.shape[1]
        return output

    def _scores(self, vectors: np.ndarray) -> np.ndarray:
        """A rerank request's: the cross-encoder's, else each document's cosine similarity
        to the query (the first vector)."""
        if self.encoder.scores:
            return vectors[:, 0]
        unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return unit[1:] @ unit[0]
