"""RequestContext: what the gateway knows about one HTTP request, from arrival to last byte.

The middleware (gateway/edge/middleware.py) creates it with the request id and the caller's key,
the routes add the model, the relay the token timings and counts, and when the response's
last byte is sent the middleware calls `finish()` once: the `on_finish` callbacks (rate-limit
accounting, metrics, the access log) read the final values there.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.edge.keys import ApiKey
    from shared.types import Timings

log = logging.getLogger("gateway")

# The gateway names every request itself (unique: the worker, the logs and cancel-by-id use
# it); a client's own X-Request-Id, when short and plain, is logged beside it.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


# Completion tokens a stream collects before they are charged to its key (ratelimit.py): a
# charge scans the key's moving window (0.26 ms with 500k tokens in it), so a stream is charged
# a few times, not per token.
METER_TOKENS = 256


def new_request_id() -> str:
    return uuid.uuid4().hex


def client_request_id(header: str | None) -> str:
    return header if header and _CLIENT_ID.fullmatch(header) else ""


@dataclass(slots=True, eq=False)
class RequestContext:
    request_id: str
    method: str
    path: str
    key: ApiKey | None = None  # None: no keys configured (open loopback gateway)
    client_request_id: str = ""
    user: str = ""  # an end-user id the client sent (OpenAI user / safety_identifier, ...)
    started: float = field(default_factory=time.perf_counter)
    model: str = ""  # as asked for, then the configured name once resolved
    model_known: bool = False  # `model` is a configured model's name (a metrics label)
    stream: bool = False
    status: int = 0
    error_code: str = ""  # the ErrorCode of a failure after the status line went out
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    worker_timings: Timings | None = None  # the worker's share of the first token's wait
    last_token_at: float | None = None
    finished_at: float | None = None
    on_finish: list[Callable[[RequestContext], None]] = field(default_factory=list)
    # Charges the tokens counted since the last charge (a key's tokens per minute, charged
    # as they arrive: ratelimit.py); `charged`: how many it has charged.
    meter: Callable[[RequestContext], None] | None = None
    charged: int = 0

    @property
    def key_name(self) -> str:
        return self.key.name if self.key is not None else "-"

    def token(self, count: int) -> None:
        """`count` completion tokens arrived now (the relay calls this per delta)."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.completion_tokens += count
        if self.meter is not None and self.uncharged >= METER_TOKENS:
            self.meter(self)

    def prompt(self, tokens: int) -> None:
        """The prompt's size, known with the first token."""
        self.prompt_tokens = max(self.prompt_tokens, tokens)
        if self.meter is not None:
            self.meter(self)

    @property
    def uncharged(self) -> int:
        return self.prompt_tokens + self.completion_tokens - self.charged

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def itl_s(self) -> float | None:
        """Mean time between tokens after the first one."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        if self.completion_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.completion_tokens - 1)

    @property
    def duration_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.started

    def finish(self) -> None:
        """Run the callbacks once (idempotent); a failing callback is logged, not raised."""
        if self.finished_at is not None:
            return
        self.finished_at = time.perf_counter()
        for callback in self.on_finish:
            try:
                callback(self)
            except Exception:
                log.exception("request %s: on_finish callback failed", self.request_id)
