"""worker/backends/parting.py through the rows batch on a real tiny model: a row at its
max_tokens leaves at a compaction before its last token is read; that token, the KV it leaves
and the rows that stay are what they would have been."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from tests.engine_fixtures import Loaded, reference_greedy
from worker.backends.rows import RowBatch
from worker.backends.sampling import greedy


def _insert(
    batch: RowBatch, chat: Loaded, prompts: list[list[int]], budgets: list[int]
) -> list[int]:
    return batch.insert(
        prompts,
        [make_prompt_cache(chat.model) for _ in prompts],
        [[] for _ in prompts],
        [greedy] * len(prompts),
        [[] for _ in prompts],
        budgets=budgets,
    )


def _run(batch: RowBatch, steps: int, out: dict[int, list[int]], **step: Any) -> None:
    for _ in range(steps):
        for uid, token, _ in batch.step(**step):
            out.setdefault(uid, []).append(token)


def test_rows_at_their_max_tokens_leave_as_another_joins_and_their_kv_goes_on(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model)
    out: dict[int, list[int]] = {}
    ending = _insert(batch, chat, prompts[:2], [3, 3])
    _run(batch, 3, out)  # the third step built is the one that draws their last tokens
    assert batch.decodes == 3 and [len(out[u]) for u in ending] == [2, 2]
    late = _insert(batch, chat, prompts[2:3], [5])
    _run(batch, 1, out, keep_caches=True)
    # they left before the joiner's first step: it runs alone, unpadded, with no mask
    assert [r.uid for r in batch.rows] == late and not batch.padded
    assert set(batch.parting.ended) == set(ending)
    for uid, prompt in zip(ending, prompts[:2], strict=True):
        assert out[uid] == reference_greedy(chat.model, prompt, 3), uid
        cache, held = batch.parting.ended[uid]
        assert held == prompt + out[uid][:2]  # the KV of every token but the last
        # ... which a later row goes on from, token for token as mlx-lm alone
        again = RowBatch(chat.model)
        uids = again.insert(
            [[out[uid][2]]], [cache.caches(len(held))], [held], [greedy], [[]], budgets=[4]
        )
        more: dict[int, list[int]] = {}
        _run(again, 6, more)
        assert more[uids[0]] == reference_greedy(chat.model, prompt, 7)[3:], uid
        assert not again.active  # alone at its max_tokens: it left without another step
    _run(batch, 6, out)
    assert out[late[0]] == reference_greedy(chat.model, prompts[2], 5)
    assert not batch.active  # it left at its fifth token: nothing more came


def test_rows_all_at_their_max_tokens_leave_without_another_step(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model)
    out: dict[int, list[int]] = {}
    uids = _insert(batch, chat, prompts[:3], [4, 4, 4])
    _run(batch, 4, out)
    assert batch.decodes == 4 and batch.active
    _run(batch, 1, out)
    assert batch.decodes == 4 and batch.rows == [] and not batch.active
    for uid, prompt in zip(uids, prompts[:3], strict=True):
        assert out[uid] == reference_greedy(chat.model, prompt, 4), uid


def test_a_row_at_its_max_tokens_among_others_decodes_on_until_a_compaction(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """One of five at its max_tokens is under the compaction share: nothing changes for the
    batch (the engine reads its last token and removes it as any other); the rest go on."""
    batch = RowBatch(chat.model)
    out: dict[int, list[int]] = {}
    uids = _insert(batch, chat, prompts[:5], [2, 50, 50, 50, 50])
    _run(batch, 3, out)
    assert len(batch.rows) == 5 and not batch.parting.ended and len(out[uids[0]]) == 2
    batch.remove([uids[0]])
    _run(batch, 10, out)
    for uid, prompt in zip(uids[1:], prompts[1:5], strict=True):
        assert out[uid] == reference_greedy(chat.model, prompt, 12), uid
