"""Wire frames between the gateway and its workers (msgspec msgpack over ZeroMQ).

Gateway ROUTER <- worker DEALER (identity = worker id) carries gateway -> worker frames;
worker PUSH -> gateway PULL carries worker -> gateway frames. Every frame is one Struct of a
tagged union; hot-path Structs are array_like (positional: no field names on the wire) and
gc=False. Fields are only appended, with defaults, so an older peer's shorter arrays still
decode (msgspec 0.23 writes every field of an array_like Struct, defaults included);
tests/test_protocol.py pins the bytes.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from shared.types import CanonicalRequest, RequestKind, RequestOutput, SamplingParams

PROTOCOL_VERSION = 14


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    PROBING = "probing"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class _Frame(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="t"):
    pass


# ---- gateway -> worker -------------------------------------------------------------


class Add(_Frame, tag="add"):
    request_id: str
    kind: RequestKind
    request: CanonicalRequest
    sampling: SamplingParams
    # Scheduling class: INTERACTIVE first; BATCH requests wait while interactive ones do and
    # hold at most `engine.batch_share` of the running batch (see worker/daemon.py).
    priority: int = 0
    # A worker on another machine: the session (its Hello's) it was sent to. One still in
    # flight when the worker joined again is dropped there: the gateway sends it again.
    session: int = 0


class Abort(_Frame, tag="abort"):
    request_ids: list[str]


class Control(_Frame, tag="ctl"):
    call_id: int
    method: str
    args: dict[str, Any] = {}


class ShutdownMode(enum.StrEnum):
    DRAIN = "drain"
    ABORT = "abort"


class Shutdown(_Frame, tag="shutdown"):
    mode: ShutdownMode = ShutdownMode.ABORT
    timeout_s: float = 10.0


class Rejoin(_Frame, tag="rejoin"):
    """To a worker on another machine that the gateway does not know (it restarted, or it
    took the worker for lost): drop every request it runs (the gateway no longer waits for
    them) and say Hello and Ready again."""

    reason: str = ""
    # the session the gateway took for lost (-1: it knows none); a worker that has said
    # Hello in a later one since ignores it
    session: int = -1


class Refuse(_Frame, tag="refuse"):
    """To a worker on another machine that may not serve here (a model the gateway does not
    serve, or other weights than its replicas', another protocol version): it exits, saying
    why."""

    reason: str


# ---- worker -> gateway -------------------------------------------------------------


class Hello(_Frame, tag="hello"):
    worker_id: str
    protocol_version: int
    pid: int
    model: str
    # A worker on another machine counts its joins: each Hello after a dropped connection
    # or a Rejoin starts a new session, and its StepOutputs carry the session they belong
    # to, so that tokens of requests it dropped, still in flight, are never taken for
    # tokens of the requests sent to it since.
    session: int = 0


class Capacity(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    max_running: int
    max_waiting: int
    max_context: int


class Ready(_Frame, tag="ready"):
    worker_id: str
    capacity: Capacity
    versions: dict[str, str] = {}
    capabilities: list[str] = []
    load_time_s: float = 0.0
    device: str = ""  # MLX's device: "gpu" (Metal or CUDA) or "cpu"
    device_memory_bytes: int = 0  # what that device can hold (GPU memory, or host RAM on CPU)
    prefix_cache_bytes: int = 0  # the prefix cache's bound (0: off)
    # The weights it serves: a digest of their config and index (shared/modelinfo.py);
    # every replica of a model must serve the same.
    identity: str = ""


class StepOutputs(_Frame, tag="step"):
    worker_id: str
    step: int
    outputs: list[RequestOutput]
    session: int = 0  # the Hello's whose requests these are
    # A remote worker numbers each session's step outputs from 1, those of its engine
    # (step >= 0) and its refusals (step -1) apart: a gap means frames were lost on the way.
    seq: int = 0


class PrefixCacheStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The worker's prefix cache, cumulative since the worker started."""

    entries: int = 0
    nbytes: int = 0  # held now
    capacity_bytes: int = 0
    lookups: int = 0  # requests that looked for a cached prefix
    hits: int = 0  # of those, requests that reused one
    hit_tokens: int = 0  # prompt tokens not prefilled thanks to the cache
    evictions: int = 0
    oversize: int = 0  # caches not kept: each larger than the whole bound


class PromptSegmentStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The worker's memo of chat prompts' segments (worker/prompt_segments.py), cumulative
    since the worker started."""

    entries: int = 0  # segments held now
    nbytes: int = 0  # their text and token ids, held now (as Python holds them)
    capacity_bytes: int = 0
    prompts: int = 0  # chat prompts tokenized by segments
    hits: int = 0  # segments found in the memo
    misses: int = 0  # segments encoded
    evictions: int = 0


class Heartbeat(_Frame, tag="hb"):
    worker_id: str
    state: WorkerState
    step: int
    running: int
    waiting: int
    memory_bytes: int = 0  # the process's resident set
    active_bytes: int = 0  # MLX: arrays alive (weights, KV cache, activations)
    cache_bytes: int = 0  # MLX: freed buffers kept for reuse
    peak_bytes: int = 0  # MLX: high-water mark of active memory
    stage: str = ""  # while loading: "downloading", "loading weights", "probing"
    progress: float = -1.0  # of that stage, 0..1; -1 when unknown
    prefix_cache: PrefixCacheStats | None = None
    wired_limit_bytes: int = 0  # MLX memory kept resident (Metal; 0: none set)
    cache_limit_bytes: int = 0  # the bound of MLX's buffer cache (0: MLX's default)
    prompt_segments: PromptSegmentStats | None = None  # protocol 12 (None: off, or none)


class ControlReply(_Frame, tag="ctlr"):
    worker_id: str
    call_id: int
    ok: bool
    result: dict[str, Any] = {}
    error: str | None = None


class WorkerDead(_Frame, tag="dead"):
    worker_id: str
    reason: str
    traceback_tail: str = ""


ToWorker = Add | Abort | Control | Shutdown | Rejoin | Refuse
FromWorker = Hello | Ready | StepOutputs | Heartbeat | ControlReply | WorkerDead

# What decoding a bad frame raises: msgspec.DecodeError (a ValidationError is one), or a
# RecursionError for msgpack nested deeper than msgspec follows (inside an Any field such as
# Control.args). Either side logs such a frame and drops it.
UNDECODABLE = (msgspec.DecodeError, RecursionError)


class Codec:
    """Encoders and decoders for both directions; one per thread or task (not shared)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_worker = msgspec.msgpack.Decoder(ToWorker)
        self.from_worker = msgspec.msgpack.Decoder(FromWorker)

    def encode(self, frame: _Frame) -> bytes:
        return self.encoder.encode(frame)
