"""Reuse of earlier requests' KV: a prompt that shares a prefix with one seen before
prefills only the rest.

Each entry is the KV cache of one finished sequence (prompt and generated tokens) with the
tokens it holds. A lookup finds the entry sharing the longest common prefix with the new
prompt, not only an entry that the prompt extends: a chat template that renders the
previous answer a little differently still reuses everything before the difference. Such
a partial hit needs a cache that can be trimmed back to the common prefix; caches that
cannot (sliding-window or state-space layers) are reused only when the prompt extends the
entry's tokens exactly. At least one prompt token is always left to prefill (the model must
see it to give the first token's logits).

Bounded in bytes, least recently used out first; an entry larger than the whole bound is
not kept. Entries are indexed by their first `KEY_TOKENS` tokens, so a lookup compares the
prompt only with entries that begin as it does (a prefix shorter than that is not worth a
hit), and at most `MAX_ENTRIES` are kept, whatever their size.

The cache objects are the backend's: this module reaches them only through `CacheOps`, so it
is tested without a model.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shared.protocol import PrefixCacheStats

KEY_TOKENS = 16
MAX_ENTRIES = 1024


class CacheOps(Protocol):
    def nbytes(self, cache: Any) -> int: ...

    def trimmable(self, cache: Any) -> bool: ...

    def prefix(self, cache: Any, length: int, tokens: int) -> Any:
        """A cache holding the first `length` of the `tokens` positions `cache` holds; the
        stored cache itself stays as it is (it may be handed out again)."""
        ...


@dataclass(slots=True, eq=False)
class Entry:
    tokens: np.ndarray  # int64, the tokens whose KV the cache holds
    cache: Any
    nbytes: int
    trimmable: bool


@dataclass(frozen=True, slots=True)
class Hit:
    cache: Any
    length: int  # prompt tokens the cache covers


class PrefixCache:
    def __init__(self, capacity_bytes: int, ops: CacheOps) -> None:
        self.capacity = capacity_bytes
        self.ops = ops
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.index: dict[tuple[int, ...], set[int]] = {}  # first KEY_TOKENS tokens -> keys
        self.nbytes = 0
        self._next_key = 0
        self.lookups = self.hits = self.hit_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            len(self.entries),
            self.nbytes,
            self.capacity,
            self.lookups,
            self.hits,
            self.hit_tokens,
            self.evictions,
        )

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(key, length): the entry that covers the most of `prompt`, and how much; (-1, 0)
        when none covers any. Changes nothing."""
        limit = len(prompt) - 1  # the last prompt token is always prefilled
        if limit < KEY_TOKENS:
            return -1, 0
        candidates = self.index.get(tuple(prompt[:KEY_TOKENS]))
        if not candidates:
            return -1, 0
        query = np.asarray(prompt, dtype=np.int64)
        best_key, best = -1, 0
        for key in candidates:
            entry = self.entries[key]
            common = _common_prefix(entry.tokens, query)
            if entry.trimmable:
                usable = min(common, limit)
            else:  # only an exact extension of the entry
                usable = common if common == len(entry.tokens) <= limit else 0
            if usable > best or (usable == best and usable and key > best_key):
                best_key, best = key, usable
        return best_key, best

    def lookup(self, prompt: list[int]) -> Hit | None:
        """The cache for the longest usable prefix of `prompt`, counted as a hit; None on a
        miss. The entry becomes the most recently used."""
        self.lookups += 1
        key, length = self.match(prompt)
        if length == 0:
            return None
        entry = self.entries[key]
        self.entries.move_to_end(key)
        self.hits += 1
        self.hit_tokens += length
        return Hit(self.ops.prefix(entry.cache, length, len(entry.tokens)), length)

    def insert(self, tokens: list[int], cache: Any) -> bool:
        """Keep `cache`, which holds the KV of `tokens`. Entries it makes useless go: those
        whose tokens are a prefix of these (when it can be trimmed to serve them) and an
        identical one. False when it is larger than the whole bound (not kept)."""
        nbytes = self.ops.nbytes(cache)
        if nbytes > self.capacity or len(tokens) <= KEY_TOKENS:
            return False
        array = np.asarray(tokens, dtype=np.int64)
        trimmable = self.ops.trimmable(cache)
        head = tuple(tokens[:KEY_TOKENS])
        for key in list(self.index.get(head, ())):
            entry = self.entries[key]
            if len(entry.tokens) > len(array) or not (trimmable or len(entry.tokens) == len(array)):
                continue
            if _common_prefix(entry.tokens, array) == len(entry.tokens):
                self._drop(key)
        while self.entries and (
            self.nbytes + nbytes > self.capacity or len(self.entries) >= MAX_ENTRIES
        ):
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        key = self._next_key
        self._next_key += 1
        self.entries[key] = Entry(array, cache, nbytes, trimmable)
        self.index.setdefault(head, set()).add(key)
        self.nbytes += nbytes
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        head = tuple(int(t) for t in entry.tokens[:KEY_TOKENS])
        keys = self.index[head]
        keys.discard(key)
        if not keys:
            del self.index[head]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
