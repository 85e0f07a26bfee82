"""Per-key limits: requests per minute, tokens per minute, requests in flight.

Counted in the gateway process, which every request of every model passes through, so the
limits hold across models and workers. Requests and tokens use the `limits` library's moving
window. A request is admitted while its key's token window has room; its tokens are charged
as they become known: the prompt's with the first token, the completion's as they stream (every
METER_TOKENS), the rest when it ends. Requests in flight when the window fills still
finish, so a key overruns its `tpm` by what those go on to use (its `concurrency` bounds how
many), and a long stream's tokens count in the minutes they arrive, not all in its last.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from gateway.edge.context import RequestContext
from gateway.edge.keys import ApiKey
from gateway.errors import GatewayError
from shared.types import ErrorCode


@dataclass(slots=True)
class _Window:
    limit: int
    remaining: int
    reset_s: int  # seconds until the window has room again


class KeyLimiter:
    def __init__(self) -> None:
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self._in_flight: dict[str, int] = {}
        self._items: dict[tuple[str, int], RateLimitItem] = {}

    def _item(self, kind: str, amount: int) -> RateLimitItem:
        item = self._items.get((kind, amount))
        if item is None:
            item = self._items[(kind, amount)] = RateLimitItemPerMinute(amount, namespace=kind)
        return item

    def _window(self, kind: str, amount: int, key_id: str) -> _Window:
        stats = self._limiter.get_window_stats(self._item(kind, amount), key_id)
        reset = max(0, math.ceil(stats.reset_time - time.time()))
        return _Window(amount, max(0, stats.remaining), reset)

    def in_flight(self, key_id: str) -> int:
        return self._in_flight.get(key_id, 0)

    def admit(self, ctx: RequestContext, key: ApiKey) -> list[tuple[bytes, bytes]]:
        """Count the request against its key, or raise a 429 GatewayError (with `headers`).

        Returns the RateLimit headers for the response; on success the request holds one of
        its key's concurrency slots until `ctx.finish()`.
        """
        headers: list[tuple[bytes, bytes]] = []
        refusal: tuple[str, int] | None = None
        if key.concurrency is not None and self.in_flight(key.id) >= key.concurrency:
            refusal = (f"{key.concurrency} requests in flight at once", 1)
        if key.tpm is not None:
            tokens = self._window("tpm", key.tpm, key.id)
            headers += _openai_headers("tokens", tokens)
            if key.rpm is None:
                headers += _ietf_headers(tokens)
            if refusal is None and tokens.remaining <= 0:
                refusal = (f"{key.tpm} tokens per minute", max(1, tokens.reset_s))
        if key.rpm is not None:
            item = self._item("rpm", key.rpm)
            allowed = refusal is None and self._limiter.hit(item, key.id)
            requests = self._window("rpm", key.rpm, key.id)
            headers += _openai_headers("requests", requests)
            headers += _ietf_headers(requests)
            if refusal is None and not allowed:
                refusal = (f"{key.rpm} requests per minute", max(1, requests.reset_s))
        if refusal is not None:
            what, retry = refusal
            raise GatewayError(
                ErrorCode.RATE_LIMITED,
                f"rate limit of key {key.name!r} reached: {what}; retry in {retry} s",
                retry_after=retry,
                headers=headers,
            )
        self.track(ctx, key)
        return headers

    def track(self, ctx: RequestContext, key: ApiKey) -> None:
        """Count `ctx` in flight for `key` until it finishes, then charge its tokens (also
        for work that outlives its HTTP request: a background response)."""
        self._in_flight[key.id] = self.in_flight(key.id) + 1
        if key.tpm is not None:
            ctx.meter = lambda c: self._charge(c, key)
        ctx.on_finish.append(lambda c: self._done(c, key))

    def _done(self, ctx: RequestContext, key: ApiKey) -> None:
        left = self._in_flight.get(key.id, 1) - 1
        if left > 0:
            self._in_flight[key.id] = left
        else:
            self._in_flight.pop(key.id, None)
        ctx.meter = None
        self._charge(ctx, key)

    def _charge(self, ctx: RequestContext, key: ApiKey) -> None:
        """Charge what `ctx` counted since its last charge (the window takes no more than
        it has room for: past that the key is refused until it moves)."""
        due = ctx.uncharged
        if key.tpm is None or due <= 0:
            return
        ctx.charged += due
        window = self._window("tpm", key.tpm, key.id)
        charge = min(due, window.remaining)
        if charge > 0:
            self._limiter.hit(self._item("tpm", key.tpm), key.id, cost=charge)


def _openai_headers(kind: str, window: _Window) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers (clients such as the openai SDK read these)."""
    return [
        (f"x-ratelimit-limit-{kind}".encode(), str(window.limit).encode()),
        (f"x-ratelimit-remaining-{kind}".encode(), str(window.remaining).encode()),
        (f"x-ratelimit-reset-{kind}".encode(), f"{window.reset_s}s".encode()),
    ]


def _ietf_headers(window: _Window) -> list[tuple[bytes, bytes]]:
    """RateLimit-Limit / -Remaining / -Reset (IETF httpapi draft), for the request window."""
    return [
        (b"ratelimit-limit", str(window.limit).encode()),
        (b"ratelimit-remaining", str(window.remaining).encode()),
        (b"ratelimit-reset", str(window.reset_s).encode()),
    ]
