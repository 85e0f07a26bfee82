"""worker/backends/shelves.py: rows' KV out of the batch in one copy per layer, each row
exactly what mlx-lm's own `BatchKVCache.extract` gives."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from tests.engine_fixtures import Loaded
from worker.backends.rows import RowBatch
from worker.backends.sampling import greedy
from worker.backends.shelves import SPREAD, Shelved, shelve, storage, take_out


def batch_caches(pads: list[int], end: int, layers: int = 2) -> list[BatchKVCache]:
    """Batch caches of `layers` layers, rows right-aligned at `end` after `pads`."""
    caches = []
    for layer in range(layers):
        cache = BatchKVCache(pads)
        keys = mx.random.normal((len(pads), 2, end, 4), key=mx.random.key(layer))
        cache.update_and_fetch(keys, keys * 2)
        caches.append(cache)
    return caches


def same_as_mlx_lm(kept: Shelved, caches: list[BatchKVCache], index: int) -> bool:
    theirs = [c.extract(index) for c in caches]
    ours = kept.caches()
    return all(
        a.offset == b.offset
        and mx.array_equal(a.keys, b.keys).item()
        and mx.array_equal(a.values, b.values).item()
        for a, b in zip(ours, theirs, strict=True)
    )


def test_the_batch_cache_state_it_reads() -> None:
    """mlx-lm 0.32's BatchKVCache.state: keys, values, offset, left padding and the end of
    the positions written (an int). A release that changed it fails here (and the batch
    would copy row by row, through extract)."""
    [cache] = batch_caches([0, 3], 8, layers=1)
    state = cache.state
    assert isinstance(state, tuple) and len(state) == 5 and state[4] == 8
    assert state[3].tolist() == [0, 3] and state[0].shape[2] >= 8


@pytest.mark.parametrize("gather", [True, False, None], ids=["gather", "concat", "default"])
def test_rows_of_about_the_same_length_share_a_shelf(gather: bool | None) -> None:
    end = 64
    pads = [0, 4, 8, 40, 2]  # lengths 64, 60, 56, 24, 62
    caches = batch_caches(pads, end)
    rows = [(i, end - p) for i, p in enumerate(pads)]
    kept = shelve(caches, rows, max_bytes=1 << 30, gather=gather)
    assert kept is not None and len(kept) == 5
    long = {kept[i].shelf for i in (0, 1, 2, 4)}
    # 56 is the shortest within SPREAD of 64 (56 * 8 = 64 * 7); 24 is not
    assert SPREAD == 8 and len(long) == 1 and kept[3].shelf not in long
    per_position = 2 * 2 * 2 * 4 * 4  # layers x (keys, values) x heads x dim x float32
    assert kept[0].shelf.nbytes == 4 * 64 * per_position
    assert [k.nbytes for k in kept] == [(end - p) * per_position for p in pads]
    for i, k in enumerate(kept):
        assert k.length == end - pads[i] and same_as_mlx_lm(k, caches, i), i
        assert storage(k) == (k.shelf, k.shelf.nbytes)
    assert storage([object()]) is None


def test_a_shelf_stays_under_its_bound() -> None:
    end = 32
    caches = batch_caches([0, 0, 0, 1, 1], end)
    per_position = 2 * 2 * 2 * 4 * 4
    kept = shelve(caches, [(i, 32 if i < 3 else 31) for i in range(5)], 2 * 32 * per_position)
    assert kept is not None
    shelves = {id(k.shelf) for k in kept}
    assert len(shelves) == 3 and all(k.shelf.nbytes <= 2 * 32 * per_position for k in kept)
    for i, k in enumerate(kept):
        assert same_as_mlx_lm(k, caches, i), i


def test_a_row_cut_short_and_copied_out() -> None:
    caches = batch_caches([0, 2], 16)
    kept = shelve(caches, [(1, 14), (0, 16)], max_bytes=1 << 30)
    assert kept is not None and [k.length for k in kept] == [14, 16]  # in the order asked
    first = kept[0].caches(5)
    theirs = caches[0].extract(1)
    assert first[0].offset == 5
    assert mx.array_equal(first[0].keys, theirs.keys[:, :, :5]).item()
    own = kept[0].copy()
    assert all(c.offset == 14 for c in own)
    assert mx.array_equal(own[1].values, caches[1].extract(1).values).item()


def test_a_cache_state_that_reads_otherwise_is_not_shelved() -> None:
    class Other:
        state = (mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)), 0)

    assert shelve([Other()], [(0, 1)], 1 << 30) is None
    caches = batch_caches([0, 0], 8)
    caches[1].update_and_fetch(mx.zeros((2, 2, 1, 4)), mx.zeros((2, 2, 1, 4)))
    assert shelve(caches, [(0, 8)], 1 << 30) is None  # layers disagree on their end
    [kept] = take_out(caches, [(1, 8)], 1 << 30)  # then row by row, through mlx-lm
    assert isinstance(kept, list) and [c.offset for c in kept] == [8, 9]


def test_the_batch_shelves_rows_it_takes_out_mid_decode(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Rows of several lengths, some steps into decoding: each one's KV is mlx-lm's, and
    holds exactly the tokens the batch says it holds."""
    batch = RowBatch(chat.model)
    uids = batch.insert(
        prompts[:4],
        [make_prompt_cache(chat.model) for _ in prompts[:4]],
        [[] for _ in prompts[:4]],
        [greedy] * 4,
        [[] for _ in prompts[:4]],
    )
    for _ in range(6):
        batch.step()
    kept = batch.extract(uids)
    assert sorted(kept) == sorted(uids)
    by_uid = {r.uid: i for i, r in enumerate(batch.rows)}
    for uid, (cache, held) in kept.items():
        assert isinstance(cache, Shelved) and cache.length == len(held)
        assert same_as_mlx_lm(cache, batch.caches, by_uid[uid]), uid
