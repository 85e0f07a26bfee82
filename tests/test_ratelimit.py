"""KeyLimiter.track: a request (or work that outlives its HTTP request: a background response)
is counted in flight, and its tokens are charged to the key's tokens per minute as they
arrive and when it ends."""

from __future__ import annotations

import time

from gateway.edge.context import METER_TOKENS, RequestContext
from gateway.edge.keys import ApiKey
from gateway.edge.ratelimit import KeyLimiter


def test_track_holds_a_slot_and_charges_tokens_at_the_end() -> None:
    key = ApiKey(id="k1", name="bg", hash="x", created_at=time.time(), tpm=100, concurrency=2)
    limiter = KeyLimiter()
    job = RequestContext("r1", "BACKGROUND", "/v1/responses", key=key)
    limiter.track(job, key)
    assert limiter.in_flight("k1") == 1
    assert limiter._window("tpm", 100, "k1").remaining == 100
    job.prompt_tokens, job.completion_tokens = 30, 20
    job.finish()
    assert limiter.in_flight("k1") == 0
    assert limiter._window("tpm", 100, "k1").remaining == 50


def test_a_requests_tokens_are_charged_as_they_arrive() -> None:
    key = ApiKey(id="k2", name="live", hash="x", created_at=time.time(), tpm=1000)
    limiter = KeyLimiter()
    ctx = RequestContext("r2", "POST", "/v1/chat/completions", key=key)
    limiter.track(ctx, key)
    ctx.prompt(30)  # with the first token
    assert limiter._window("tpm", 1000, "k2").remaining == 970
    ctx.token(METER_TOKENS - 1)  # not yet: every METER_TOKENS
    assert limiter._window("tpm", 1000, "k2").remaining == 970
    ctx.token(1)
    assert limiter._window("tpm", 1000, "k2").remaining == 970 - METER_TOKENS
    ctx.completion_tokens = METER_TOKENS + 5  # the final usage
    ctx.finish()
    assert limiter._window("tpm", 1000, "k2").remaining == 970 - METER_TOKENS - 5
    assert ctx.charged == 30 + METER_TOKENS + 5


def test_a_key_without_a_token_limit_is_not_metered() -> None:
    key = ApiKey(id="k3", name="free", hash="x", created_at=time.time(), rpm=10)
    ctx = RequestContext("r3", "POST", "/v1/chat/completions", key=key)
    KeyLimiter().track(ctx, key)
    assert ctx.meter is None
    ctx.prompt(30)
    ctx.finish()
    assert ctx.charged == 0
