"""A request inside the engine: what it asks for, where it is, and its output state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from shared.types import SamplingParams, TokenLogprob
from worker.engine.detokenize import Detokenizer
from worker.engine.prefix_cache import PromptKey
from worker.engine.stop import StopStringMatcher
from worker.parsing.response import ResponseParser
from worker.structured.guide import Guide


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # accepted, in the scheduler's queue
    SCORING = "scoring"  # echo + logprobs: its prompt is scored before it is scheduled
    PREFILLING = "prefilling"  # in the backend's batch, no token yet
    RUNNING = "running"  # in the batch, generating
    FINISHED = "finished"

    @property
    def in_batch(self) -> bool:
        return self in (RequestStatus.PREFILLING, RequestStatus.RUNNING)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    uid: int | None = None  # the backend's id while in its batch
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of them, made while thinking
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (EOS unless ignored, stop ids)
    # perf_counter: the worker got it, had it prepared, started it in the batch
    received_at: float = 0.0
    prepared_at: float = 0.0
    admitted_at: float = 0.0
    # output state (engine/output.py)
    detokenizer: Detokenizer | None = None  # one per request
    stop: StopStringMatcher = field(default_factory=lambda: StopStringMatcher([]))
    # echo: the prompt's text and logprobs, sent with the first delta and then dropped
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    guide: Guide | None = None  # a grammar / thinking budget over its tokens (the batch's)
    parser: ResponseParser | None = None  # answer, thinking and tool calls of its text
    # a prompt with images: the model's arrays for them (backends' Media), and the prompt as
    # the prefix cache keys it (each image token replaced by an id of the image's content)
    media: Any = None
    key: list[int] | None = None
    # a continuation: its prompt's last `resumed` tokens are output an earlier worker made
    resumed: int = 0

    # its cache key as lookups see it, made at the first (prefix_cache.PromptKey)
    _prefix_key: PromptKey | None = field(default=None, init=False, repr=False)

    @property
    def cache_key(self) -> list[int]:
        """The prompt as the prefix cache sees it."""
        return self.key if self.key is not None else self.prompt

    @property
    def prefix_key(self) -> PromptKey:
        """`cache_key` with its block chain and array, each made once (the prompt and its
        key are set when the request is made and never change)."""
        if self._prefix_key is None:
            self._prefix_key = PromptKey(self.cache_key)
        return self._prefix_key

    def keyed(self, tokens: list[int]) -> list[int]:
        """Tokens a row of this request holds, as the prefix cache keys them."""
        if self.key is None:
            return tokens
        n = len(self.key)
        return self.key[: min(n, len(tokens))] + tokens[n:]

    @property
    def ready(self) -> bool:
        """It may start: nothing it needs is still being made (its grammar compiling)."""
        return self.guide is None or self.guide.ready()

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs
