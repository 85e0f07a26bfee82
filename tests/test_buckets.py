"""worker/backends/buckets.py: which rows that left a compaction keeps to round the batch's
row count up to a multiple of the bucket, and that it keeps none where that would cost the
batch more than their rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.backends.buckets import BUCKET_FROM, ROW_BUCKET, bucketed, free_riders


def greedy(x: Any) -> Any:
    return x


def other(x: Any) -> Any:
    return x


@dataclass
class Row:
    length: int
    dead: bool = False
    sampler: Any = greedy
    processors: list[Any] = field(default_factory=list)
    guide: Any = None
    shift: int = 0

    @property
    def held(self) -> list[int]:
        return [0] * self.length


def batch(running: int, left: list[Row], length: int = 100) -> tuple[list[Row], list[int]]:
    rows = [Row(length) for _ in range(running)] + left
    return rows, list(range(running))


def test_from_32_rows_the_count_rounds_up_to_the_bucket() -> None:
    assert (ROW_BUCKET, BUCKET_FROM) == (8, 32)
    rows, keep = batch(33, [Row(100, dead=True) for _ in range(7)])
    kept = bucketed(rows, keep, 1, ROW_BUCKET)  # 33 + 1 joining: 6 more make 40
    assert len(kept) == 39 and kept[:33] == keep and all(rows[i].dead for i in kept[33:])
    assert bucketed(rows, keep, 7, ROW_BUCKET) == keep  # 40 already
    assert bucketed(rows, keep, 0, 1) == keep  # off


def test_below_32_rows_and_short_of_riders_the_count_is_exact() -> None:
    rows, keep = batch(20, [Row(100, dead=True) for _ in range(7)])
    assert bucketed(rows, keep, 1, ROW_BUCKET) == keep  # 21: small batches stay exact
    rows, keep = batch(33, [Row(100, dead=True) for _ in range(5)])
    assert bucketed(rows, keep, 1, ROW_BUCKET) == keep  # 6 needed, 5 could stay: none
    assert bucketed(rows, [], 40, ROW_BUCKET) == []  # nothing running: the joiners alone


def test_only_rows_that_cost_nothing_but_their_row_stay() -> None:
    ok = Row(90, dead=True)
    left = [
        Row(120, dead=True),  # longer than every running row: would lengthen the KV
        Row(90, dead=True, sampler=other),  # a sampler no running row uses: a second call
        Row(90, dead=True, processors=[object()]),  # per-row logits processing
        Row(90, dead=True, guide=object()),  # the guided step's work
        Row(90, dead=True, shift=3),  # positions shifted: keeps the forward pass
        Row(90, dead=False),  # running: never a rider
        ok,
    ]
    rows, keep = batch(33, left)
    assert free_riders(rows, keep, joining=1) == [rows.index(ok)]


def test_into_an_unpadded_batch_only_rows_of_its_length_stay() -> None:
    # running rows of one length and none joining: the step has no mask; a shorter row
    # would bring one
    rows, keep = batch(33, [Row(90, dead=True), Row(100, dead=True)])
    assert free_riders(rows, keep, joining=0) == [34]
    assert free_riders(rows, keep, joining=1) == [33, 34]  # joiners pad the batch anyway
    rows[0] = Row(80)  # already padded: shorter rows may stay
    assert free_riders(rows, keep, joining=0) == [33, 34]
