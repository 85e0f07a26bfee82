"""A continuous batch of our own over an mlx-lm model, on its public pieces: the model's
forward pass and mlx-lm's `BatchKVCache` (merge, prepare, finalize, extend, filter, extract).

What it changes against mlx-lm's BatchGenerator is what a row joining or leaving costs the
batch (docs/benchmarks.md measured a join at four to five decode steps on a GPU whose step is
bound by the host):
- joining rows are prefilled together (grouped by how many chunks their prompts take; two
  groups at a time, a chunk of each per step; groups.py), without waiting on the device, and
  each takes its first token from its own prefill (`first`, groups.py: it joins the batch
  with that token as its input) or, where that is off, from the running batch's next step
  (one forward pass for all rows): never a pass of its own;
- a row that leaves is only marked: it decodes on, unseen, until enough rows have left (or
  rows join) to compact the batch in one filter;
- into a large batch, rows join a few at a time (a join costs the batch two copies of its KV
  and a prefill pass, however many rows join): joiners wait until there are
  `running // JOIN_DIVISOR` of them, or until the oldest has waited as many steps; with
  `settle_steps` (`engine.join_settle_steps`, default 0: off), a group big enough to start
  waits until no row has arrived for that many steps, within the same bound;
- while no running row is padded (one row, or rows that started together), a decode step
  passes the model no attention mask: with one, MLX's CUDA backend leaves its fused
  one-token attention kernel for separate matmul, softmax and matmul kernels;
- the host builds step n+1 while the device runs step n, as BatchGenerator does, and splits
  a step's distribution into one array per row only while a request asks for logprobs
  (BatchGenerator always does: at 128 rows on an H200, up to a third of a step);
- a step with a prefill due and a first token pending only reads the tokens (`_flush`);
- with `early_first`, rows that join an idle batch have their first tokens read by the step
  that prefilled them, before the next step is built (`_flush` again: that step is built
  by the next call, before any other row joins);
- with `prefill_buckets`, a group prefills at a few shapes (prefill_buckets.py).

Greedy output is the same token for token as mlx-lm's `generate_step` (tests). Stop rules
and max_tokens are the engine's: a row runs until the engine removes it.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import TokenBuffer

from worker.backends.buckets import ROW_BUCKET, bucketed
from worker.backends.groups import FirstToken, Group, Row, Waiting, prefill_chunk, start_group
from worker.backends.sampling import LogitsProcessor, Sampler, sample_rows
from worker.backends.shelves import take_out
from worker.backends.unpadded import Unpadded
from worker.structured.ahead import Ahead, GuideThread, Masked
from worker.structured.guide import Guide, Masks, pack

# Compact the batch once this share of its rows has left (and whenever rows join).
COMPACT_SHARE = 0.25
# Groups prefilling at once, a chunk of each per step (a prompt arriving during a long one's
# prefill starts beside it).
MAX_GROUPS = 2
# Into a batch of n running rows, joiners start in groups of n // JOIN_DIVISOR (or after
# waiting that many steps): at 128 rows a pair (docs/lab/2026-12-gpu-runs.md measured 4, 16 and 64).
JOIN_DIVISOR = 64


class RowBatch:
    def __init__(
        self,
        model: Any,
        prefill_step_size: int = 2048,
        max_group: int = 64,
        settle_steps: int = 0,
        decode: Any = None,
        bucket_rows: bool = False,
        shelf_bytes: int = 1 << 28,
        prefill_buckets: bool = False,
        first: FirstToken | None = None,
        early_first: bool = False,
    ) -> None:
        self.model = model
        self.first = first  # rows' first tokens from their prefill (groups.py), or None
        # rows joining an idle batch: their first tokens read before the next step is built
        self.early_first = early_first
        self.prefill_buckets = prefill_buckets  # prefills at a few shapes (prefill_buckets.py)
        self.shelf_bytes = shelf_bytes  # the most that rows leaving together share (shelves.py)
        self.bucket = ROW_BUCKET if bucket_rows else 1  # row counts kept (buckets.py)
        self.decode = decode  # the one-token step (decode_step.py), or None: the model's
        self.prefill_step_size = max(1, prefill_step_size)
        self.max_group = max(1, max_group)  # rows prefilled side by side
        # engine.join_settle_steps (module docstring; benchmarks/arrivals.py --settle)
        self.settle_steps = max(0, settle_steps)
        self.rows: list[Row] = []  # the running batch, in cache order
        self.caches: list[Any] = []
        self.step_caches: list[Any] = []  # what a decode step passes the model (unpadded.py)
        self.inputs: mx.array | None = None  # each row's next input token (lazy)
        # the distribution each pending input came from (None: a prompt token, or not asked)
        self.logprobs: list[mx.array | None] = []
        self.fresh: set[int] = set()  # rows whose input is their prompt's last token
        self.unsent: set[int] = set()  # rows whose first output token is the pending input
        # the pending inputs were read ahead of a prefill, or right after rows joined an idle
        # batch (`early_first`): by `_flush`
        self.flushed = False
        self.waiting: list[Waiting] = []
        self.groups: list[Group] = []  # prefilling, at most MAX_GROUPS
        self.uid_count = 0
        self.steps = 0
        self.waited_s = 0.0  # the host's wait for steps' tokens (benchmarks' step trace)
        self.prefilled = 0  # prompt positions run, padding included (the same trace)
        self.joined = 0  # rows that joined the running batch (the same)
        self.masks = Masks()  # guided rows' masks
        self.guided = False  # some row of the batch has a guide (set when rows change)
        self.shifts: mx.array | None = None  # the rows' position shifts, when any has one
        self.version = 0  # counts changes to the batch's rows
        self._guides = GuideThread(self.masks)
        self._ahead: Ahead | None = None  # the next step's masks, being computed

    # ---- rows in and out ------------------------------------------------------------

    def insert(
        self,
        prompts: list[list[int]],
        caches: list[list[Any]],
        prefixes: list[list[int]],
        samplers: list[Sampler],
        processors: list[list[LogitsProcessor]],
        guides: list[Guide | None] | None = None,
        shifts: list[int] | None = None,
    ) -> list[int]:
        """Rows to start: the prompt tokens to run after the `prefix` tokens whose KV each
        cache holds (at least one token each)."""
        uids = []
        guides = guides or [None] * len(prompts)
        shifts = shifts or [0] * len(prompts)
        for prompt, cache, prefix, sampler, procs, guide, shift in zip(
            prompts, caches, prefixes, samplers, processors, guides, shifts, strict=True
        ):
            if not prompt:
                raise ValueError("a row needs at least one prompt token to run")
            uid, self.uid_count = self.uid_count, self.uid_count + 1
            held = list(prefix) + list(prompt[:-1])
            row = Row(uid, sampler, procs, held, prompt[-1], TokenBuffer(held) if procs else None)
            row.guide, row.shift = guide, shift
            rest = list(prompt) if self.first else list(prompt[:-1])
            self.waiting.append(Waiting(row, rest, cache, self.steps))
            uids.append(uid)
        return uids

    def remove(self, uids: list[int], keep_caches: bool = False) -> dict[int, tuple[Any, list]]:
        """Rows out (the batch drops them at its next compaction); with `keep_caches`, a copy
        of each one's cache and the tokens it holds."""
        wanted = set(uids)
        kept = self.extract(uids) if keep_caches else {}
        self.waiting = [w for w in self.waiting if w.row.uid not in wanted]
        pending = [r for g in self.groups for r in g.rows]
        for row in [*self.rows, *pending]:
            if row.uid in wanted:
                row.dead = True
        if self.rows and all(r.dead for r in self.rows):
            self._compact()  # nothing left to decode: let the KV go now
        self.groups = [g for g in self.groups if any(not r.dead for r in g.rows)]
        return kept

    def extract(self, uids: list[int]) -> dict[int, tuple[Any, list[int]]]:
        """Copies of running rows' caches (shelved, worker/backends/shelves.py) and the
        tokens each holds."""
        wanted = set(uids)
        found = [(i, r) for i, r in enumerate(self.rows) if r.uid in wanted and not r.dead]
        if not found:
            return {}
        kept = take_out(self.caches, [(i, len(r.held)) for i, r in found], self.shelf_bytes)
        return {r.uid: (cache, list(r.held)) for (_, r), cache in zip(found, kept, strict=True)}

    def holds(self, uid: int) -> bool:
        group = [r for g in self.groups for r in g.rows]
        rows = [*self.rows, *group, *(w.row for w in self.waiting)]
        return any(r.uid == uid and not r.dead for r in rows)

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.groups or any(not r.dead for r in self.rows))

    # ---- a step ---------------------------------------------------------------------

    def step(self, logprobs: bool = True) -> list[tuple[int, int, mx.array | None]]:
        """Prefill a chunk of the joining rows, decode the running ones; the tokens sampled
        at the step before, as (uid, token, the distribution it was drawn from). With
        `logprobs` False, the distributions of this step's tokens are not split per row
        (their tokens come back at the next step with None): a cost at every step,
        proportional to the rows, that only requests for logprobs need."""
        if self._flush_due():
            return self._flush()
        self.steps += 1
        while self.waiting and len(self.groups) < MAX_GROUPS and self._join_due():
            self.groups.append(self._start_group())
        for group in self.groups:
            self.prefilled += prefill_chunk(self.model, group, self.prefill_step_size, self.first)
        joined = [g for g in self.groups if g.tokens is None]
        if self.flushed and self.first is not None and any(not r.dead for r in self.rows):
            # rows read early (`early_first`) take their next step before any row joins:
            # that step appends the tokens `_flush` read, a joiner's is not among them
            joined = []
        if joined or self._dead_share() >= COMPACT_SHARE:
            self._compact(sum(not r.dead for g in joined for r in g.rows))
        # no row decoding before the joiners (asked only where it decides something)
        idle = bool(joined) and self.early_first and not any(not r.dead for r in self.rows)
        for group in joined:
            self._join(group, logprobs)
        joining = {id(g) for g in joined}
        self.groups = [g for g in self.groups if id(g) not in joining]
        if not self.rows or self.inputs is None:
            return []
        if joined and self.first is not None:
            # the joiners' first tokens as an evaluation of their own: read by this call,
            # before the step built next is done
            mx.async_eval(self.inputs)
            if idle and not self.guided:
                return self._flush()  # read now; the next call builds the next step
        return self._decode(logprobs)

    def _flush_due(self) -> bool:
        """Whether this call only reads the pending tokens (module docstring); not if guided."""
        if not self.unsent or self.flushed or self.guided or self.inputs is None:
            return False
        due = self.waiting and len(self.groups) < MAX_GROUPS and self._join_due()
        return bool(self.groups or due)

    def _flush(self) -> list[tuple[int, int, mx.array | None]]:
        assert self.inputs is not None and not self.fresh
        self.flushed = True  # the tokens go into `held` once the step writing their KV is built
        return self._take(self._read(self.inputs), self.logprobs, hold=False)

    def _read(self, inputs: mx.array) -> list[int]:
        waiting = time.perf_counter()
        tokens: list[int] = inputs.tolist()  # type: ignore[assignment]  # waits for the step
        self.waited_s += time.perf_counter() - waiting
        return tokens

    def _take(
        self, tokens: list[int], logprobs: list[mx.array | None], hold: bool = True
    ) -> list[tuple[int, int, mx.array | None]]:
        """A step's tokens: into the rows' `held` (or `pending`), out but for prompt tokens."""
        out, first = [], self.fresh  # rows whose prompt's last token this is
        for row, token, row_logprobs in zip(self.rows, tokens, logprobs, strict=True):
            if hold:
                row.held.append(token)
            else:
                row.pending = token
            if row.uid not in first and not row.dead:
                out.append((row.uid, token, row_logprobs))
        self.unsent, self.fresh = first, set()  # every other row's token went out
        return out

    def _join_due(self) -> bool:
        """Whether the waiting rows start now (see the module's docstring)."""
        need = sum(not r.dead for r in self.rows) // JOIN_DIVISOR
        if need <= 1 or self.steps - self.waiting[0].since >= need:
            return True
        quiet = self.steps - self.waiting[-1].since - 1  # steps since the last arrival
        return len(self.waiting) >= need and quiet >= self.settle_steps

    def _start_group(self) -> Group:
        group, self.waiting = start_group(
            self.waiting, self.prefill_step_size, self.max_group, self.prefill_buckets
        )
        return group

    def _dead_share(self) -> float:
        return sum(r.dead for r in self.rows) / len(self.rows) if self.rows else 0.0

    def _compact(self, joining: int = 0) -> None:
        """Drops the rows that left (before `joining` rows join); with `bucket_rows`, some
        may stay to round the batch's row count up (worker/backends/buckets.py)."""
        keep = [i for i, r in enumerate(self.rows) if not r.dead]
        if self.bucket > 1:
            keep = bucketed(self.rows, keep, joining, self.bucket)
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.caches, self.inputs, self.logprobs = [], [], None, []
            self.step_caches, self.shifts = [], None
            self.fresh.clear()
            self.unsent.clear()
            self.flushed = False
            self.version += 1
            # the masks being computed are for rows that are gone (a failure there concerns
            # no one left: it must not end a later batch)
            self._ahead = None
            return
        for c in self.caches:
            c.filter(keep)
        assert self.inputs is not None
        self.inputs = self.inputs[mx.array(keep)]
        self.logprobs = [self.logprobs[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]
        self.fresh.intersection_update(r.uid for r in self.rows)
        self.unsent.intersection_update(r.uid for r in self.rows)
        self._note_padding()

    def _join(self, group: Group, want_logprobs: bool) -> None:
        live = [i for i, r in enumerate(group.rows) if not r.dead]
        if not live:
            return
        if len(live) < len(group.rows):
            for c in group.caches:
                c.filter(live)
        rows = [group.rows[i] for i in live]
        last = mx.array([r.last for r in rows], dtype=mx.uint32)  # as sampled: no int64 mix
        logprobs: list[mx.array | None] = [None] * len(rows)  # a prompt token has none
        if self.first is not None:  # their first tokens, from the prefill (groups.py)
            logits = self.first.logits(group)
            if len(live) < len(group.rows):
                logits = logits[mx.array(live)]
            first, lines = sample_rows(rows, last, self._masked_first(rows, logits))
            if want_logprobs:
                logprobs = list(lines)
            for r in rows:
                r.held.append(r.last)
        else:
            first = last
        if self.rows:
            for mine, theirs in zip(self.caches, group.caches, strict=True):
                mine.extend(theirs)
            assert self.inputs is not None
            self.inputs = mx.concatenate([self.inputs, first])
        else:
            self.caches, self.inputs = group.caches, first
        self.rows += rows
        self.joined += len(rows)
        self.logprobs += logprobs
        if self.first is None:
            self.fresh.update(r.uid for r in rows)
        self._note_padding()

    def _masked_first(self, rows: list[Row], logits: mx.array) -> mx.array:
        """The joining rows' first logits masked by their guides (at their start: the guide
        thread sees them at the next step, which takes the token sampled here)."""
        guided = [i for i, r in enumerate(rows) if r.guide is not None]
        if not guided:
            return logits
        bitmask, filled = self.masks.fill([rows[i].guide for i in guided])  # type: ignore[misc]
        at = [i for i, f in zip(guided, filled, strict=True) if f]
        if not at:
            return logits
        lines = bitmask[[j for j, f in enumerate(filled) if f]]
        return self.masks.apply(logits, lines, None if len(at) == len(rows) else at)

    def _note_padding(self) -> None:
        """After the batch's rows changed: whether any is padded (and any guided). A row
        holds the KV of its `held` tokens, right-aligned at the cache's size (every step
        appends one to each)."""
        self.guided = any(r.guide is not None for r in self.rows)
        shifted = any(r.shift for r in self.rows)
        self.shifts = mx.array([r.shift for r in self.rows]) if shifted else None
        self.version += 1
        size = self.caches[0].size()
        if all(len(r.held) == size for r in self.rows):
            self.step_caches = [Unpadded(c) for c in self.caches]
        else:
            self.step_caches = self.caches

    @property
    def padded(self) -> bool:
        """Whether a decode step masks the batch's attention (some row is padded)."""
        return self.step_caches is self.caches

    def _decode(self, want_logprobs: bool) -> list[tuple[int, int, mx.array | None]]:
        inputs = self.inputs
        assert inputs is not None
        if self.decode is not None and self.shifts is None:
            logits = self.decode(inputs, self.caches, masked=self.padded)
        else:
            shifted = {"shifts": self.shifts} if self.shifts is not None else {}
            logits = self.model(inputs[:, None], cache=self.step_caches, **shifted)[:, -1, :]
        tokens: list[int] | None = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None or self.guided:
            logits, tokens = self._guide(logits, inputs, ahead)
        sampled, logprobs = sample_rows(self.rows, inputs, logits)
        # the guide thread's own handle on this step's tokens (an array only it waits on)
        probe = mx.contiguous(sampled) if self.guided else None
        rows_logprobs: list[mx.array | None]
        if want_logprobs:
            rows_logprobs = list(logprobs)
            mx.async_eval(sampled, probe, rows_logprobs)
        else:
            rows_logprobs = [None] * len(self.rows)
            mx.async_eval(sampled, probe)
        previous = self.logprobs
        self.inputs, self.logprobs = sampled, rows_logprobs
        out = []
        if self.flushed:  # read at the call before (`pending`), but for rows joined since
            # (fresh: their prompt's last token; rows with first tokens from their prefill
            # join only once this step is built)
            self.flushed = False
            for row in self.rows:
                row.held.append(row.last if row.uid in self.fresh else row.pending)
            self.unsent |= self.fresh
            self.fresh.clear()
        else:
            out = self._take(tokens if tokens is not None else self._read(inputs), previous)
        if probe is not None:
            self._ahead = self._guides.submit(probe, list(self.rows), self.version)
        return out

    def _guide(
        self, logits: mx.array, inputs: mx.array, ahead: Ahead | None
    ) -> tuple[mx.array, list[int] | None]:
        """Masks the guided rows' logits: with the masks the guide thread computed for this
        step (it took each row's previous token), and those of rows it did not see (joined
        this step). Returns the step's input tokens too when the thread read them for the
        batch's rows as they are (None: the caller reads them)."""
        masked: Masked | None = None
        if ahead is not None:
            if not ahead.future.done():
                # the device runs the forward pass while the thread finishes
                mx.async_eval(logits)
            masked = ahead.future.result()
        same = masked is not None and ahead is not None and ahead.version == self.version
        tokens = masked.tokens if same and masked is not None else None
        at: list[int] = []  # rows masked, and their bitmask lines
        lines: list[np.ndarray] = []
        if masked is not None:
            if same:
                for j, i in enumerate(masked.at):
                    if not self.rows[i].dead:
                        at.append(i)
                        lines.append(masked.bitmask[j])
            else:
                assert ahead is not None
                index = {r.uid: i for i, r in enumerate(self.rows) if not r.dead}
                for j, i in enumerate(masked.at):
                    now = index.get(ahead.rows[i].uid)
                    if now is not None:
                        at.append(now)
                        lines.append(masked.bitmask[j])
        packed = None  # the thread's device array, while it still says it all
        if same and masked is not None and len(at) == len(masked.at):
            packed = masked.packed
        late: list[Row] = []  # rows the thread did not see: joined this step
        if not same:
            seen = {r.uid for r in ahead.rows} if ahead is not None else set()
            late = [r for r in self.rows if r.guide and r.uid not in seen and not r.dead]
        if late:
            if tokens is None and any(r.uid not in self.fresh for r in late):
                mx.async_eval(logits)
                tokens = inputs.tolist()  # type: ignore[assignment]
            position = {r.uid: i for i, r in enumerate(self.rows)}
            for r in late:
                if r.uid not in self.fresh:  # its first token, sampled from its prefill
                    assert r.guide is not None and tokens is not None
                    r.guide.consume(tokens[position[r.uid]])
            bitmask, filled = self.masks.fill([r.guide for r in late])  # type: ignore[misc]
            for r, line, forbids in zip(late, bitmask, filled, strict=True):
                if forbids:
                    at.append(position[r.uid])
                    lines.append(line)
                    packed = None
        for row in self.rows:
            if row.guide is not None:
                row.guide.settle()
        if not at:
            return logits, tokens
        if packed is None:
            every = len(at) == len(self.rows)
            if every:
                order = sorted(range(len(at)), key=at.__getitem__)
                lines = [lines[k] for k in order]
            packed = pack(np.stack(lines), None if every else at)
        return self.masks.apply_packed(logits, packed), tokens
