"""What the engine needs from a model library: a continuous batch it can insert into, step
and remove from, the KV cache operations of the prefix cache, and prompt scoring.
`worker/backends/` implements it (mlx-lm today); the engine is written against this alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from shared.types import SamplingParams


@dataclass(slots=True)
class Insertion:
    """One sequence into the batch: the prompt tokens to prefill, after `prefix` tokens
    whose KV `cache` already holds (None: no cached prefix)."""

    prompt: list[int]
    prefix: list[int]
    cache: Any
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    guide: Any = None  # worker.structured.guide.Guide: masks its next tokens
    shift: int = 0  # added to its positions (an mRoPE model's prompt with images)
    drawn: int = 0  # a continuation's tokens drawn before: its seeded sampler goes on after


@dataclass(slots=True)
class Sampled:
    """One row's token from a step; `ended` when it reached its max_tokens there, with its
    cache and the tokens that cache holds (`cache` None unless asked for)."""

    uid: int
    token: int
    logits: Any  # the row the token was drawn from (an mx.array, for logprobs)
    ended: bool
    cache: Any = None
    tokens: list[int] | None = None


class Backend(Protocol):
    tokenizer: Any
    eos_ids: frozenset[int]
    prefill_batch_size: int

    @property
    def detokenizer_kind(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def active(self) -> bool:
        """Anything in the batch."""
        ...

    def holds(self, uid: int) -> bool:
        """The row is in the batch (prefilling or decoding) and not removed."""
        ...

    def insert(self, items: list[Insertion]) -> list[int]: ...

    def step(self, keep_caches: bool, logprobs: bool = True) -> list[Sampled]:
        """One step of the batch. With `logprobs` False no row's distribution is asked for
        at the next step (`Sampled.logits` may then be None): no request in the batch wants
        logprobs."""
        ...

    def remove(
        self, uids: list[int], keep_caches: bool = False
    ) -> dict[int, tuple[Any, list[int]]]: ...

    def extract(self, uids: list[int]) -> dict[int, tuple[Any, list[int]]]: ...

    # the prefix cache's CacheOps
    def nbytes(self, cache: Any) -> int: ...

    def trimmable(self, cache: Any) -> bool: ...

    def prefix(self, cache: Any, length: int, tokens: int) -> Any: ...

    def storage(self, cache: Any) -> tuple[Any, int] | None: ...

    def own(self, cache: Any) -> Any: ...

    def compact(self, caches: list[Any]) -> None:
        """Caches taken out of the batch, on their way into the prefix cache."""
        ...

    def new_cache(self) -> Any: ...

    def kv_bytes_per_token(self) -> int: ...

    def forward_logprobs(self, tokens: list[int], cache: Any) -> Any: ...

    def release_memory(self) -> None: ...
