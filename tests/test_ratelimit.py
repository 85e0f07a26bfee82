"""KeyLimiter.track: work that outlives its HTTP request (a background response) is counted
in flight and charged to the key's tokens per minute when it ends."""

from __future__ import annotations

import time

from gateway.edge.context import RequestContext
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
