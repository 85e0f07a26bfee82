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

Entries are found through a chain of block hashes, as vLLM's prefix caching does: the
tokens are cut into blocks of `BLOCK` tokens and block i's key hashes block i's tokens with
block i-1's key, so one key stands for a whole prefix. A lookup walks the prompt's chain as
far as some entry shares it and compares tokens only with a few entries found there (the
most recently used first): its cost grows with the prompt, not with the number of entries.
Hits shorter than one block are not worth a copy and are not looked for.

Bounded in bytes, least recently used out first, and at most `MAX_ENTRIES` entries; an entry
larger than the whole bound is not kept. Caches may share their storage (rows that left the
batch together, copied out at once: worker/backends/shelves.py): the storage is counted once,
while any cache on it is kept. When the least recently used entry on a storage is evicted,
the storage goes: the entries on it that were hit since they came get a copy of their own
and stay where they are in the order, the others go with it. A storage that its entries
use less than half of (the rest left, covered by longer entries) is given up the same way,
each entry left copied out. (A cache handed out on a hit is a view of the storage too: it
keeps it alive, uncounted, until the batch has copied it in, should it be evicted
meanwhile.) The cache objects are the backend's: this module reaches them only through
`CacheOps`, so it is tested without a model.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shared.protocol import PrefixCacheStats

BLOCK = 16
MAX_ENTRIES = 1024
CANDIDATES = 4  # entries compared token by token at the deepest shared block


class CacheOps(Protocol):
    def nbytes(self, cache: Any) -> int: ...

    def trimmable(self, cache: Any) -> bool: ...

    def prefix(self, cache: Any, length: int, tokens: int) -> Any:
        """A cache holding the first `length` of the `tokens` positions `cache` holds; the
        stored cache itself stays as it is (it may be handed out again)."""
        ...

    def storage(self, cache: Any) -> tuple[Any, int] | None:
        """The storage `cache` shares with other caches and its bytes (all of them stay
        while any of those caches does); None for a cache of its own."""
        ...

    def own(self, cache: Any) -> Any:
        """A cache holding the same KV in storage of its own."""
        ...


@dataclass(slots=True, eq=False)
class Entry:
    tokens: np.ndarray  # int64, the tokens whose KV the cache holds
    chain: list[int]  # the key of each full block
    cache: Any
    nbytes: int  # its own positions
    trimmable: bool
    owner: Any = None  # the storage it shares with others (CacheOps.storage), if any
    owner_bytes: int = 0
    hit: bool = False  # looked up since it was stored


@dataclass(frozen=True, slots=True)
class Hit:
    cache: Any
    length: int  # prompt tokens the cache covers


def block_chain(tokens: list[int]) -> list[int]:
    """The key of each full block of `tokens`: a hash of the block and of the key before."""
    chain: list[int] = []
    key = 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        key = hash((key, *tokens[start : start + BLOCK]))
        chain.append(key)
    return chain


class PromptKey:
    """A prompt as lookups see it, its block chain and its array each made once: a request's
    scheduling and its start look one prompt up two or three times."""

    __slots__ = ("_array", "_chain", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self._chain: list[int] | None = None
        self._array: np.ndarray | None = None

    @property
    def chain(self) -> list[int]:
        """The key of each full block of all but the last token (always prefilled)."""
        if self._chain is None:
            self._chain = block_chain(self.tokens[:-1])
        return self._chain

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.asarray(self.tokens, dtype=np.int64)
        return self._array


class PrefixCache:
    def __init__(self, capacity_bytes: int, ops: CacheOps) -> None:
        self.capacity = capacity_bytes
        self.ops = ops
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.blocks: dict[int, set[int]] = {}  # block key -> entries holding that prefix
        self.ends: dict[int, set[int]] = {}  # block key -> entries whose last full block it is
        self.owners: dict[Any, set[int]] = {}  # shared storage -> the entries on it
        self.nbytes = 0  # entries' own bytes, and each shared storage once
        self._next_key = 0
        self.lookups = self.hits = self.hit_tokens = self.evictions = self.oversize = 0

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
            self.oversize,
        )

    def match(self, prompt: list[int] | PromptKey) -> tuple[int, int]:
        """(key, length): the entry that covers the most of `prompt`, and how much; (-1, 0)
        when none covers a block's worth. Changes nothing."""
        prompt = prompt if isinstance(prompt, PromptKey) else PromptKey(prompt)
        limit = len(prompt.tokens) - 1  # the last prompt token is always prefilled
        chain = prompt.chain
        depth = 0
        while depth < len(chain) and chain[depth] in self.blocks:
            depth += 1
        if depth == 0:
            return -1, 0
        query = prompt.array
        best_key, best = -1, 0
        for level in range(depth - 1, -1, -1):  # the deepest shared block first
            keys = self.blocks[chain[level]]
            for key in heapq.nlargest(CANDIDATES, keys):  # keys grow with each use
                usable = self._usable(self.entries[key], query, limit)
                if usable > best:
                    best_key, best = key, usable
            if best:  # a shallower block cannot share more
                return best_key, best
        return best_key, best

    def _usable(self, entry: Entry, query: np.ndarray, limit: int) -> int:
        common = _common_prefix(entry.tokens, query)
        if entry.trimmable:
            return min(common, limit)
        # an untrimmable cache: only an exact extension of the entry
        return common if common == len(entry.tokens) <= limit else 0

    def lookup(self, prompt: list[int] | PromptKey) -> Hit | None:
        """The cache for the longest usable prefix of `prompt`, counted as a hit; None on a
        miss. The entry becomes the most recently used."""
        self.lookups += 1
        key, length = self.match(prompt)
        if length == 0:
            return None
        entry = self._touch(key)
        entry.hit = True
        self.hits += 1
        self.hit_tokens += length
        return Hit(self.ops.prefix(entry.cache, length, len(entry.tokens)), length)

    def insert(self, tokens: list[int], cache: Any) -> bool:
        """Keep `cache`, which holds the KV of `tokens`. Entries it makes useless go: those
        whose tokens are a prefix of these (when it can be trimmed to serve them) and an
        identical one. False when it is not kept: too short to be found, or larger than the
        whole bound (counted in `oversize`)."""
        nbytes = self.ops.nbytes(cache)
        if len(tokens) <= BLOCK:
            return False
        if nbytes > self.capacity:
            self.oversize += 1
            return False
        shared = self.ops.storage(cache)
        if shared is not None and shared[1] > self.capacity:  # could never be counted
            cache, shared = self.ops.own(cache), None
        array = np.asarray(tokens, dtype=np.int64)
        chain = block_chain(tokens)
        trimmable = self.ops.trimmable(cache)
        for block in chain:  # entries whose every full block these tokens share
            for key in list(self.ends.get(block, ())):
                entry = self.entries[key]
                covered = len(entry.tokens) <= len(array) and (
                    trimmable or len(entry.tokens) == len(array)
                )
                if covered and _common_prefix(entry.tokens, array) == len(entry.tokens):
                    self._drop(key)
                    self._settle(entry.owner)
        owner, owner_bytes = shared if shared is not None else (None, 0)
        entry = Entry(array, chain, cache, nbytes, trimmable, owner, owner_bytes)
        while self.entries and len(self.entries) >= MAX_ENTRIES:
            self._evict(next(iter(self.entries)))
        self._fit(entry)
        self._add(entry)
        return True

    def _new_bytes(self, entry: Entry) -> int:
        """What keeping `entry` adds to the count."""
        if entry.owner is None:
            return entry.nbytes
        return 0 if entry.owner in self.owners else entry.owner_bytes

    def _fit(self, entry: Entry | None = None) -> None:
        """Least recently used entries out until `entry` fits (the bound holds, without)."""
        while self.entries:
            adding = self._new_bytes(entry) if entry is not None else 0
            if self.nbytes + adding <= self.capacity:
                return
            self._evict(next(iter(self.entries)))

    def _evict(self, key: int) -> None:
        """The entry out, and its storage if it shares one: the entries on it that were hit
        copied out (they stay), the others out too. Frees at least the entry's own bytes
        (a storage holds all of its entries' positions)."""
        owner = self._drop(key).owner
        self.evictions += 1
        for k in sorted(self.owners.get(owner, ())) if owner is not None else ():
            if self.entries[k].hit:
                self._own(k)
            else:
                self._drop(k)
                self.evictions += 1

    def _settle(self, owner: Any) -> None:
        """A storage whose entries use under half of it is given up: each copied out."""
        members = self.owners.get(owner) if owner is not None else None
        if members:
            used = sum(self.entries[k].nbytes for k in members)
            if 2 * used < self.entries[next(iter(members))].owner_bytes:
                for k in sorted(members):
                    self._own(k)

    def _own(self, key: int) -> None:
        """The entry on storage of its own (a copy), in the same place in the order."""
        entry = self.entries[key]
        members = self.owners[entry.owner]
        members.discard(key)
        if not members:
            del self.owners[entry.owner]
            self.nbytes -= entry.owner_bytes
        entry.cache = self.ops.own(entry.cache)
        entry.owner, entry.owner_bytes = None, 0
        self.nbytes += entry.nbytes

    def clear(self) -> None:
        """Forget every entry and every count (the worker's probe is no one's request)."""
        self.entries.clear()
        self.owners.clear()
        self.blocks.clear()
        self.ends.clear()
        self.nbytes = 0
        self.lookups = self.hits = self.hit_tokens = self.evictions = self.oversize = 0

    def _add(self, entry: Entry) -> int:
        key = self._next_key
        self._next_key += 1
        self.nbytes += self._new_bytes(entry)
        self.entries[key] = entry
        if entry.owner is not None:
            self.owners.setdefault(entry.owner, set()).add(key)
        for block in entry.chain:
            self.blocks.setdefault(block, set()).add(key)
        self.ends.setdefault(entry.chain[-1], set()).add(key)
        return key

    def _touch(self, key: int) -> Entry:
        """Most recently used: re-added under a new (larger) key."""
        entry = self._drop(key)
        self._add(entry)
        return entry

    def _drop(self, key: int) -> Entry:
        entry = self.entries.pop(key)
        if entry.owner is None:
            self.nbytes -= entry.nbytes
        else:
            members = self.owners[entry.owner]
            members.discard(key)
            if not members:
                del self.owners[entry.owner]
                self.nbytes -= entry.owner_bytes
        for block in entry.chain:
            _discard(self.blocks, block, key)
        _discard(self.ends, entry.chain[-1], key)
        return entry


def _discard(index: dict[int, set[int]], block: int, key: int) -> None:
    keys = index.get(block)
    if keys is not None:
        keys.discard(key)
        if not keys:
            del index[block]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
