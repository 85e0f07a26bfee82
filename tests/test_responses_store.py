"""The Responses API's store of responses: its bound drops the oldest, the TTL counts from a
response's end (fake clock), and each key sees only its own."""

from __future__ import annotations

from gateway.api.responses.store import ResponseStore, StoredResponse
from gateway.api.responses.translate import new_response
from tests.responses_helpers import Clock, _key, _request


def _entry(owner: str | None = None, status: str = "completed") -> StoredResponse:
    return StoredResponse(new_response(_request(), status=status), owner, [])


def test_store_bound_drops_the_oldest() -> None:
    store = ResponseStore(3, 60, Clock())
    entries = [_entry() for _ in range(5)]
    dropped = []
    for entry in entries:
        dropped += store.add(entry)
        store.ended(entry)
    assert dropped == entries[:2]
    assert len(store) == 3
    assert store.get(entries[0].id, None) is None
    assert store.get(entries[4].id, None) is entries[4]


def test_store_bound_drops_what_ended_before_what_runs() -> None:
    """Another key's plain requests must not end a background response still running."""
    store = ResponseStore(3, 60, Clock())
    job = _entry("k1", status="in_progress")
    assert store.add(job) == []
    plain = [_entry("k2") for _ in range(4)]
    dropped = []
    for entry in plain:
        dropped += store.add(entry)
        store.ended(entry)
    assert dropped == plain[:2] and store.get(job.id, None) is job
    jobs = [_entry(status="in_progress") for _ in range(3)]  # the store full of running ones
    for entry in jobs:
        dropped += store.add(entry)
    assert store.get(job.id, None) is None and job in dropped  # only then the oldest goes


def test_the_expiry_heap_stays_near_the_bound() -> None:
    store = ResponseStore(2, 3600, Clock())
    for _ in range(1000):
        entry = _entry()
        store.add(entry)
        store.ended(entry)
    assert len(store) == 2 and len(store._expiry) <= 2 * 2 + 64 + 1


def test_store_ttl_counts_from_the_end() -> None:
    clock = Clock()
    store = ResponseStore(10, 60, clock)
    running = _entry(status="queued")
    done = _entry()
    store.add(running)
    store.add(done)
    store.ended(done)
    clock.now += 59.9
    assert store.get(done.id, None) is done
    clock.now += 0.1
    assert store.get(done.id, None) is None
    assert store.get(running.id, None) is running  # a running one has no TTL yet
    clock.now += 1000
    assert store.get(running.id, None) is running
    store.ended(running)
    clock.now += 30
    assert store.get(running.id, None) is running
    clock.now += 30
    assert store.get(running.id, None) is None and len(store) == 0


def test_store_negative_ttl_keeps_until_dropped() -> None:
    clock = Clock()
    store = ResponseStore(1, -1, clock)
    first, second = _entry(), _entry()
    store.add(first)
    store.ended(first)
    clock.now += 1e9
    assert store.get(first.id, None) is first
    store.add(second)
    assert store.get(first.id, None) is None


def test_store_visibility_by_key() -> None:
    store = ResponseStore(10, 60, Clock())
    mine, open_one = _entry("k1"), _entry(None)
    store.add(mine)
    store.add(open_one)
    assert store.get(mine.id, _key("k1")) is mine
    assert store.get(mine.id, _key("k2")) is None
    assert store.get(mine.id, _key("boss", "admin")) is mine
    assert store.get(mine.id, None) is mine  # an open gateway: everyone
    assert store.get(open_one.id, _key("k1")) is None
    assert store.delete(mine.id, _key("k2")) is None
    assert store.delete(mine.id, _key("k1")) is mine
    assert store.get(mine.id, _key("k1")) is None
