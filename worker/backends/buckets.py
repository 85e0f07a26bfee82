"""Row buckets: on MLX's CUDA backend the rows batch (worker/backends/rows.py) keeps its row
count a multiple of ROW_BUCKET from BUCKET_FROM rows up.

There the first decode step at a row count a process has not met costs 40-100 ms more than
the next ones (kernels, plans and traces built for the shape: benchmarks/new_shapes.py), and
a served batch moves through every count up to its size: on the H200 such steps were about
10 % of a 1B model's served time at c = 128 (docs/lab/2026-12-gpu-runs.md). So a compaction
leaves in the batch as many of the rows that left as round its count up (they decode on,
unseen, until a later compaction), when that many can stay at no cost but their rows; else
none stays.
From 32 rows, the KV of the rows kept (which the scheduler's memory budget does not count)
is at most 7/32 of the batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROW_BUCKET = 8
BUCKET_FROM = 32


def bucketed(rows: Sequence[Any], keep: list[int], joining: int, bucket: int) -> list[int]:
    """The rows a compaction keeps: `keep` (the running ones, by index), and the rows that
    left needed to make the count with `joining` rows a multiple of `bucket`, when enough
    of them may stay (`free_riders`)."""
    count = len(keep) + joining
    need = -count % bucket
    if not keep or count < BUCKET_FROM or not need:
        return keep
    riders = free_riders(rows, keep, joining)
    return sorted(keep + riders[:need]) if len(riders) >= need else keep


def free_riders(rows: Sequence[Any], keep: list[int], joining: int) -> list[int]:
    """The rows that left which may stay without changing how the batch steps:
    - no longer than the longest running row: every row grows a token a step, so they never
      lengthen the batch's KV (nor outlive a context limit);
    - of its length when the running rows are of one length and none join: no attention
      mask where there was none;
    - drawn by a sampler a running row uses: one sampling call stays one;
    - with no logits processors, guide or position shift: each keeps per-row work going."""
    running = [rows[i] for i in keep]
    longest = max(len(r.held) for r in running)
    even = joining == 0 and all(len(r.held) == longest for r in running)
    samplers = {id(r.sampler) for r in running}
    return [
        i
        for i, r in enumerate(rows)
        if r.dead
        and (len(r.held) == longest if even else len(r.held) <= longest)
        and id(r.sampler) in samplers
        and not r.processors
        and r.guide is None
        and not r.shift
    ]
