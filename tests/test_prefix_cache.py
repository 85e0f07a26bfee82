"""The prefix cache alone, over fake caches: which entry a prompt reuses, how much of it,
and what is evicted."""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import PrefixCacheStats
from shared.types import SamplingParams
from worker.engine.prefix_cache import BLOCK as KEY_TOKENS
from worker.engine.prefix_cache import MAX_ENTRIES, PrefixCache, PromptKey, block_chain
from worker.engine.request import Request

HEAD = list(range(1000, 1000 + KEY_TOKENS))  # a shared start, long enough to be indexed


@dataclass
class FakeCache:
    """Holds `length` positions at `per_token` bytes each."""

    length: int
    trimmable: bool = True
    per_token: int = 1
    copies: int = 0
    storage: Storage | None = None  # shared with other caches (rows shelved together)


@dataclass(eq=False)
class Storage:
    nbytes: int
    owned: int = 0  # caches copied out of it on their own


class FakeOps:
    def nbytes(self, cache: FakeCache) -> int:
        return cache.length * cache.per_token

    def trimmable(self, cache: FakeCache) -> bool:
        return cache.trimmable

    def prefix(self, cache: FakeCache, length: int, tokens: int) -> FakeCache:
        assert cache.trimmable or length == tokens, "an untrimmable cache was cut"
        cache.copies += 1
        return FakeCache(length, cache.trimmable, cache.per_token)

    def storage(self, cache: FakeCache) -> tuple[Storage, int] | None:
        return (cache.storage, cache.storage.nbytes) if cache.storage is not None else None

    def own(self, cache: FakeCache) -> FakeCache:
        if cache.storage is not None:
            cache.storage.owned += 1
        return FakeCache(cache.length, cache.trimmable, cache.per_token)


def seq(*tail: int) -> list[int]:
    return HEAD + list(tail)


def store(cache: PrefixCache, tokens: list[int], trimmable: bool = True) -> FakeCache:
    entry = FakeCache(len(tokens), trimmable)
    assert cache.insert(tokens, entry)
    return entry


def test_the_same_prompt_again_reuses_all_but_its_last_token() -> None:
    cache = PrefixCache(10_000, FakeOps())
    prompt = seq(1, 2, 3)
    store(cache, [*prompt, 7, 8])  # the prompt and the tokens it generated
    hit = cache.lookup(prompt)
    assert hit is not None and hit.length == len(prompt) - 1
    assert hit.cache.length == len(prompt) - 1
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (1, 1, len(prompt) - 1)


def test_the_next_turn_reuses_the_whole_previous_one() -> None:
    cache = PrefixCache(10_000, FakeOps())
    turn1 = seq(1, 2, 3, 50, 51)  # prompt + answer
    store(cache, turn1)
    turn2 = [*turn1, 60, 61, 62]  # the answer re-sent, a new user message
    hit = cache.lookup(turn2)
    assert hit is not None and hit.length == len(turn1)


def test_a_prompt_key_finds_what_its_tokens_find_its_chain_made_once() -> None:
    cache = PrefixCache(10_000, FakeOps())
    turn2 = seq(*range(1, KEY_TOKENS + 1))  # two blocks, the second ending at the last token
    key = PromptKey(turn2)
    assert cache.match(key) == (-1, 0)  # nothing stored yet
    store(cache, seq(*range(1, 11)))  # the previous turn comes in after the key was made
    chain, array = key.chain, key.array
    assert chain == block_chain(turn2[:-1]) and len(chain) == 1  # the last token: prefilled
    assert cache.match(key) == cache.match(turn2) and cache.match(key)[1] == KEY_TOKENS + 10
    assert key.chain is chain and key.array is array  # kept, not made again
    hit = cache.lookup(key)
    assert hit is not None and hit.length == KEY_TOKENS + 10


def test_a_request_looks_up_its_cache_key_through_one_prompt_key() -> None:
    request = Request("r", seq(1, 2, 3), 4, SamplingParams())
    assert request.prefix_key is request.prefix_key
    assert request.prefix_key.tokens == request.cache_key == seq(1, 2, 3)
    keyed = Request("v", seq(1, 2, 3), 4, SamplingParams(), key=seq(7, 7, 3))  # image ids
    assert keyed.prefix_key.tokens == seq(7, 7, 3)


def test_the_longest_common_prefix_not_only_an_extension() -> None:
    cache = PrefixCache(10_000, FakeOps())
    store(cache, seq(1, 2, 3, 4, 5, 6))
    store(cache, seq(1, 2, 9, 9))
    # the template rendered token 5 differently: everything before it is reused
    hit = cache.lookup(seq(1, 2, 3, 4, 99, 6, 7))
    assert hit is not None and hit.length == KEY_TOKENS + 4


def test_untrimmable_caches_serve_exact_extensions_only() -> None:
    cache = PrefixCache(10_000, FakeOps())
    store(cache, seq(1, 2, 3), trimmable=False)
    assert cache.lookup(seq(1, 2, 4, 5)) is None  # diverges inside the entry
    assert cache.lookup(seq(1, 2, 3)) is None  # would leave no token to prefill
    hit = cache.lookup(seq(1, 2, 3, 4))
    assert hit is not None and hit.length == KEY_TOKENS + 3
    assert (cache.lookups, cache.hits) == (3, 1)


def test_a_miss_and_a_short_shared_start() -> None:
    cache = PrefixCache(10_000, FakeOps())
    store(cache, seq(1, 2, 3))
    assert cache.lookup([5] * 40) is None
    assert cache.lookup(HEAD[:8] + [0] * 40) is None  # fewer than KEY_TOKENS in common
    assert cache.lookup(HEAD[:5]) is None  # too short to be indexed at all
    assert cache.hits == 0 and cache.lookups == 3


def test_eviction_by_bytes_least_recently_used_first() -> None:
    cache = PrefixCache(3 * (KEY_TOKENS + 4), FakeOps())
    a, b, c = ([n, *HEAD, 0, 0, 0] for n in (1, 2, 3))  # nothing in common
    for tokens in (a, b, c):
        store(cache, tokens)
    assert cache.nbytes == cache.capacity
    assert cache.lookup([*a, 5]) is not None  # a is now the most recently used
    store(cache, [4, *HEAD, 0, 0, 0])  # one must go: b, the least recently used
    assert cache.lookup([*b, 5]) is None
    assert cache.lookup([*a, 5]) is not None and cache.lookup([*c, 5]) is not None
    assert cache.evictions == 1 and len(cache) == 3
    assert cache.nbytes <= cache.capacity


def test_an_entry_larger_than_the_bound_is_not_kept() -> None:
    cache = PrefixCache(KEY_TOKENS + 2, FakeOps())
    small = store(cache, seq(1))
    assert not cache.insert(seq(1, 2, 3, 4), FakeCache(KEY_TOKENS + 4))
    assert cache.nbytes == small.length and len(cache) == 1
    assert cache.oversize == 1 and cache.stats().oversize == 1
    assert not cache.insert(HEAD[:5], FakeCache(5))  # too short to be found: not oversize
    assert cache.oversize == 1


def test_a_longer_entry_replaces_the_prefixes_it_covers() -> None:
    cache = PrefixCache(10_000, FakeOps())
    store(cache, seq(1, 2))
    store(cache, seq(1, 2, 3, 4))  # covers seq(1, 2) by trimming
    assert len(cache) == 1 and cache.nbytes == KEY_TOKENS + 4
    store(cache, seq(1, 2, 3, 4))  # the same tokens again: one entry
    assert len(cache) == 1


def test_an_untrimmable_entry_keeps_the_shorter_ones() -> None:
    cache = PrefixCache(10_000, FakeOps())
    store(cache, seq(1, 2), trimmable=False)
    store(cache, seq(1, 2, 3, 4), trimmable=False)
    assert len(cache) == 2
    hit = cache.lookup(seq(1, 2, 7, 7))  # extends the shorter one only
    assert hit is not None and hit.length == KEY_TOKENS + 2


def test_the_stored_cache_is_never_handed_out_itself() -> None:
    cache = PrefixCache(10_000, FakeOps())
    entry = store(cache, seq(1, 2, 3))
    first, second = cache.lookup(seq(1, 2, 3, 4)), cache.lookup(seq(1, 2, 3, 5))
    assert first is not None and second is not None
    assert first.cache is not entry and second.cache is not first.cache
    assert entry.copies == 2 and entry.length == KEY_TOKENS + 3


def test_the_entry_count_is_bounded() -> None:
    cache = PrefixCache(10**9, FakeOps())
    for i in range(MAX_ENTRIES + 5):
        store(cache, [i, *HEAD, 1])
    assert len(cache) == MAX_ENTRIES and cache.evictions == 5


def test_stats_and_clear() -> None:
    cache = PrefixCache(10_000, FakeOps())
    store(cache, seq(1, 2, 3))
    cache.lookup(seq(1, 2, 3, 4))
    stats = cache.stats()
    assert (stats.entries, stats.nbytes, stats.capacity_bytes) == (1, KEY_TOKENS + 3, 10_000)
    assert (stats.lookups, stats.hits, stats.hit_tokens) == (1, 1, KEY_TOKENS + 3)
    cache.clear()
    assert cache.stats() == PrefixCacheStats(capacity_bytes=10_000)
    assert len(cache) == 0 and cache.lookup(seq(1, 2, 3, 4)) is None


# ---- caches sharing their storage (worker/backends/shelves.py) ----------------------------


def shelf(cache: PrefixCache, tails: list[int], nbytes: int) -> Storage:
    """Entries for rows that left together: `seq(tail)` each, all on one storage."""
    storage = Storage(nbytes)
    for tail in tails:
        tokens = [tail, *HEAD, 0, 0]
        assert cache.insert(tokens, FakeCache(len(tokens), storage=storage))
    return storage


def test_a_shared_storage_is_counted_once_while_any_of_its_caches_is_kept() -> None:
    width = KEY_TOKENS + 3  # each entry's own bytes
    cache = PrefixCache(10_000, FakeOps())
    storage = shelf(cache, [1, 2, 3], nbytes=3 * width)
    assert len(cache) == 3 and cache.nbytes == 3 * width
    # a longer entry covers one of them: the storage stays with the other two
    store(cache, [1, *HEAD, 0, 0, 9])
    assert len(cache) == 3 and cache.nbytes == 3 * width + width + 1
    assert storage.owned == 0
    store(cache, [2, *HEAD, 0, 0, 9])  # one left on it: given up, that one copied out
    assert storage.owned == 1 and cache.nbytes == width + 2 * (width + 1)
    store(cache, [3, *HEAD, 0, 0, 9])
    assert len(cache) == 3 and cache.nbytes == 3 * (width + 1)


def test_caches_sharing_a_storage_are_evicted_together() -> None:
    width = KEY_TOKENS + 3
    cache = PrefixCache(100 + width, FakeOps())
    storage = shelf(cache, [1, 2, 3], nbytes=100)
    store(cache, [7, *HEAD, 0, 0])  # fits beside the storage
    assert cache.nbytes == 100 + width and cache.evictions == 0
    store(cache, [8, *HEAD, 0, 0])  # the storage is the oldest: all three go, it fits
    assert len(cache) == 2 and cache.nbytes == 2 * width and cache.evictions == 3
    assert all(cache.lookup([t, *HEAD, 0, 0, 5]) is None for t in (1, 2, 3))
    assert storage.owned == 0  # none had been hit: nothing copied


def test_a_hit_hands_out_a_view_and_the_entry_is_copied_out_only_when_its_storage_goes() -> None:
    width = KEY_TOKENS + 3
    cache = PrefixCache(100 + 2 * width - 1, FakeOps())
    storage = shelf(cache, [1, 2, 3], nbytes=100)
    hit = cache.lookup([2, *HEAD, 0, 0, 5])
    assert hit is not None and hit.length == width
    assert storage.owned == 0 and cache.nbytes == 100  # no copy while nothing presses
    store(cache, [8, *HEAD, 0, 0])  # fits beside it
    assert storage.owned == 0 and cache.nbytes == 100 + width
    store(cache, [9, *HEAD, 0, 0])  # the storage's oldest goes: the hit entry is copied out
    assert storage.owned == 1 and cache.evictions == 2
    assert cache.nbytes == 3 * width <= cache.capacity and len(cache) == 3
    assert cache.lookup([2, *HEAD, 0, 0, 5]) is not None
    assert cache.lookup([1, *HEAD, 0, 0, 5]) is None and cache.lookup([3, *HEAD, 0, 0, 5]) is None


def test_a_storage_mostly_left_is_given_up_its_entries_copied_out() -> None:
    width = KEY_TOKENS + 3
    cache = PrefixCache(10_000, FakeOps())
    storage = shelf(cache, [1, 2, 3, 4], nbytes=4 * width)
    store(cache, [1, *HEAD, 0, 0, 9])  # covers one: 3 of 4 rows still use it
    assert storage.owned == 0 and cache.nbytes == 4 * width + width + 1
    store(cache, [2, *HEAD, 0, 0, 9])  # 2 of 4: half, kept
    assert storage.owned == 0
    store(cache, [3, *HEAD, 0, 0, 9])  # 1 of 4: given up, the last one copied out
    assert storage.owned == 1 and len(cache) == 4
    assert cache.nbytes == width + 3 * (width + 1)
    assert cache.lookup([4, *HEAD, 0, 0, 5]) is not None


def test_accounting_holds_under_random_use() -> None:
    """Random shared and plain inserts, lookups and evictions: the count is always the
    bytes the kept caches reference, within the bound."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        cache = PrefixCache(rng.randrange(40, 400), FakeOps())
        for _ in range(40):
            tails = [rng.randrange(12) for _ in range(rng.randrange(1, 4))]
            if rng.random() < 0.4:
                cache.lookup([tails[0], *HEAD, 0, 0, rng.randrange(3)])
            elif rng.random() < 0.5:
                store(cache, [tails[0], *HEAD, *[0] * rng.randrange(4)])
            else:
                storage = Storage(len(tails) * (KEY_TOKENS + 3) + rng.randrange(20))
                for tail in tails:
                    tokens = [tail, *HEAD, *[0] * rng.randrange(3)]
                    cache.insert(tokens, FakeCache(len(tokens), storage=storage))
            held = {
                id(e.cache.storage): e.cache.storage.nbytes
                for e in cache.entries.values()
                if e.owner is not None
            }
            own = sum(e.nbytes for e in cache.entries.values() if e.owner is None)
            assert cache.nbytes == own + sum(held.values()) <= cache.capacity


def test_a_storage_larger_than_the_bound_is_copied_out_of_row_by_row() -> None:
    width = KEY_TOKENS + 3
    cache = PrefixCache(2 * width, FakeOps())
    storage = shelf(cache, [1, 2, 3], nbytes=10 * width)
    assert storage.owned == 3 and len(cache) == 2 and cache.nbytes == 2 * width
