"""Rows that end by length leave the rows batch (worker/backends/rows.py) a step early.

The batch reads a step's tokens only after it has built the next step (the host builds step
n+1 while the device runs step n), so the engine learns that a row drew its last token a step
late: without this, a row at its max_tokens decodes once more, and rows joining in that step
are merged into its KV (padded to its length) before the engine removes it. That is what
made a wave's first joiner slow: clients whose requests end together return together, the
first one back finds the last rows of the previous wave in their last step, and its join
step (which the rest of the wave waits behind) cost 22 ms on the H100 at the 1B shape against
9 ms on an empty batch, 48-99 against 22-26 ms at the 8B shape (docs/benchmarks.md).

The batch knows each row's max_tokens, so it knows when the step that draws a row's last token
has been built. A compaction in the next step (rows join, or enough have left) drops such
rows with the others that left: their tokens, lazy slices of the pending step's output, wait
here and come out with that step's tokens, marked as the rows' last (the engine ends the
requests there, as it does BatchGenerator's at their max_tokens), with their KV taken out
first when the engine keeps caches (the prefix cache). When they are all that runs, the
batch empties without another step. Rows that end otherwise (a stop token, a stop sequence)
are known only once their token is read, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


@dataclass(slots=True)
class Parted:
    uids: list[int]
    tokens: mx.array  # the rows' last tokens (lazy, being computed)
    logprobs: list[mx.array | None]  # the distributions they came from, where asked


@dataclass(slots=True)
class Parting:
    pending: list[Parted] = field(default_factory=list)  # tokens not yet out
    # the rows whose last tokens the step gave, with their caches and the tokens those hold
    # where kept: (None, None) where not
    ended: dict[int, tuple[Any, list[int] | None]] = field(default_factory=dict)
    _caches: dict[int, tuple[Any, list[int]]] = field(default_factory=dict)

    def keep(self, rows: Parted, caches: dict[int, tuple[Any, list[int]]]) -> None:
        mx.async_eval(rows.tokens)
        self.pending.append(rows)
        self._caches.update(caches)

    def out(self) -> list[tuple[int, int, mx.array | None]]:
        """The parted rows' last tokens, as the batch's step gives tokens (`ended` says
        which they are)."""
        self.ended = {}
        out = []
        for rows in self.pending:
            tokens: list[int] = rows.tokens.tolist()  # type: ignore[assignment]
            out += list(zip(rows.uids, tokens, rows.logprobs, strict=True))
            for uid in rows.uids:
                self.ended[uid] = self._caches.pop(uid, (None, None))
        self.pending.clear()
        return out
