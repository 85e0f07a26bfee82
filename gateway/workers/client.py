"""What the request path sees of the workers: the one door from gateway/edge and gateway/api
into gateway/workers.

`WorkerClient` is the interface the routes, the relay and the metrics use (the Supervisor
implements it; unit tests stand in for it): submit a request and read its stream, abort it,
make a control call, and read a snapshot of each model (`ModelView`). Nothing here lets a
caller reach a worker process, a slot or the pool behind them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.workers.stream import PAUSE, RequestStream
from shared.config import ModelConfig
from shared.protocol import Heartbeat, Ready
from shared.types import CanonicalRequest, RequestKind, SamplingParams

__all__ = ["PAUSE", "ModelState", "ModelView", "RequestStream", "Submission", "WorkerClient"]


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    BACKOFF = "backoff"  # crash-looped: restarts by itself at backoff_until
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ModelView:
    """One model as it stands now: a snapshot, read-only."""

    config: ModelConfig
    state: ModelState
    in_flight: int  # requests the gateway holds for it (running, queued, awaiting replay)
    restarts: int
    heartbeat: Heartbeat | None  # the serving worker's last
    info: Ready | None  # the serving worker's Ready
    last_info: Ready | None  # the last Ready of any of its workers: what it can do
    # requests its workers' deaths touched: (resumed, replayed, ended with worker_died)
    after_crash: tuple[int, int, int] = (0, 0, 0)
    generated_tokens: int = 0  # tokens its workers made, counted live (per step output)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def can_serve(self) -> bool:
        """Serving now, or able to serve on the first request (loads on demand, not failed)."""
        if self.state in (ModelState.FAILED, ModelState.BACKOFF):
            return False
        return self.state == ModelState.READY or self.config.on_demand == "load"


@dataclass(slots=True)
class Submission:
    """One generation request for one model's worker."""

    model: str
    kind: RequestKind
    request: CanonicalRequest
    sampling: SamplingParams
    request_id: str | None = None  # None: a fresh one
    priority: int = 0
    keep_alive: float | None = None  # seconds the model stays loaded once idle (-1: always)
    # Capabilities the request relies on: a model without one is a 400 before anything is
    # sent ("chat", "completion", "logprobs", "echo", "tokenize").
    needs: Sequence[str] = ()
    # What keeps a conversation on the replica holding its prefix cache (the `user` field);
    # None: the prompt's first block.
    affinity: str | None = None


class WorkerClient(Protocol):
    """The workers as the request path uses them."""

    @property
    def draining(self) -> bool:
        """Shutting down: new requests get 503 shutting_down."""
        ...

    @property
    def models(self) -> dict[str, ModelConfig]:
        """The catalog: every configured model by name."""
        ...

    def resolve(self, name: str) -> ModelConfig:
        """A model by name or alias; an unknown one is a 404 naming the available ones."""
        ...

    def view(self, name: str) -> ModelView: ...

    def views(self) -> list[ModelView]: ...

    def must_load(self, name: str) -> bool:
        """A request would wait for a worker to load or restart first."""
        ...

    def check(self, name: str, needs: Sequence[str]) -> None:
        """A 400 naming what the model cannot do, as far as is known before it loads."""
        ...

    async def submit(self, submission: Submission) -> RequestStream:
        """Into the model's worker (loaded on demand): a stream of its outputs."""
        ...

    def abort(self, stream: RequestStream) -> None:
        """The client went away or cancelled: free the request's place (idempotent)."""
        ...

    async def call(
        self, name: str, method: str, args: dict[str, Any], timeout: float = 30.0
    ) -> dict[str, Any]:
        """A control call to the model's worker (loaded on demand), e.g. detokenize."""
        ...

    async def tokenize(
        self, name: str, kind: RequestKind, request: CanonicalRequest, with_text: bool = False
    ) -> dict[str, Any]:
        """The prompt's tokens as a generation request would have them (the model's
        chat-template defaults merged in), without generating."""
        ...
