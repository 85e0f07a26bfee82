"""A timeline of the engine's steps, for benchmarks: where a served worker's time goes.

With `MLX_GATEWAY_STEP_TRACE` set to a folder, each worker appends one JSON line per engine
step to `steps-<pid>.jsonl` there: `[t, step_ms, backend_ms, inserted, insert_ms, rows,
outputs, masked, new_shapes, wait_ms, read_ahead, batch_rows, kv_size, prefilled, joined,
cpu_ms, voluntary, involuntary, cache_mb, settle_ms]`
(t: wall-clock seconds at the step's start, as `time.time()`; backend_ms: the backend's
step, the forward pass and the wait for its tokens; inserted: requests started in this step;
rows: requests in the batch after it, prefilling or decoding; outputs: deltas it produced;
masked: 1 when the rows batch stepped rows of different lengths, with an attention mask, 0
without, None on BatchGenerator; new_shapes: row counts the compiled decode step met for the
first time, each a new trace; wait_ms: of backend_ms, the rows batch's wait for the previous
step's tokens, None on BatchGenerator: the rest of backend_ms is the host's own work;
read_ahead: 1 when the rows batch only read the pending tokens ahead of a prefill, with no
forward pass, else 0, None on BatchGenerator; batch_rows: the rows batch's rows after the
step and its settle, those that left but still decode included, and kv_size its KV's
length in positions, the longest row's with the padding before the others', both None on
BatchGenerator;
prefilled: the prompt positions the rows batch ran for joining rows, padding included, and
joined: the rows that joined its running batch, both None on BatchGenerator: requests start
there a step or more after their insertion); cpu_ms: the CPU time of the thread that ran the
step (the rest of step_ms it was off the CPU: waiting for the device, for a lock, or
preempted), and voluntary / involuntary: its context switches in the step (None where the
system does not count them per thread: Linux does); cache_mb: MLX's buffer cache after the
step, in MiB; settle_ms: the engine's settle after the step (its finished rows leaving the
batch, the prefix cache's stores), once its outputs were sent, None where it had nothing to
do. The time between one step's end and the next one's start is the worker's own: emitting
the deltas, the settle, taking requests in, waiting for them.
`python -m benchmarks.step_trace` summarizes it.

Unset in production: `StepTrace.wrap` hands back the engine itself, nothing is timed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

if TYPE_CHECKING:
    from shared.types import RequestOutput
    from worker.engine.backend import Insertion, Sampled
    from worker.engine.core import EngineCore

log = logging.getLogger(__name__)

STEP_TRACE_ENV = "MLX_GATEWAY_STEP_TRACE"
FLUSH_EVERY = 2000  # steps; and whenever the engine runs out of work
BATCH_ROWS, KV_SIZE, SETTLE = 11, 12, 19  # a line's fields that settle fills
MiB = 1 << 20


def switches() -> tuple[int, int] | None:
    """The calling thread's voluntary and involuntary context switches so far (None where
    the system does not count them per thread)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    usage = resource.getrusage(who)
    return usage.ru_nvcsw, usage.ru_nivcsw


class StepTrace:
    """The engine, its steps timed. The backend's `step` and `insert` are wrapped on the
    instance (the project's own object), so the engine's code has no timing in it."""

    def __init__(self, engine: EngineCore, path: Path) -> None:
        self._engine = engine
        self._path = path
        self._rows: list[list[Any]] = []
        self._backend_s = 0.0
        self._inserted = 0
        self._insert_s = 0.0
        self._masked: int | None = None
        backend = engine.backend
        step, insert = backend.step, backend.insert
        batch = getattr(backend, "batch", None)  # the rows batch (not BatchGenerator)
        self._decode = getattr(batch, "decode", None)  # its compiled step, if any
        self._batch = batch

        def timed_step(keep_caches: bool, logprobs: bool = True) -> list[Sampled]:
            if batch is not None:
                self._masked = int(bool(batch.padded))
            t = time.perf_counter()
            try:
                return step(keep_caches, logprobs)
            finally:
                self._backend_s += time.perf_counter() - t

        def timed_insert(items: list[Insertion]) -> list[int]:
            t = time.perf_counter()
            try:
                return insert(items)
            finally:
                self._insert_s += time.perf_counter() - t
                self._inserted += len(items)

        backend.step = timed_step  # type: ignore[method-assign]
        backend.insert = timed_insert  # type: ignore[method-assign]

    @classmethod
    def wrap(cls, engine: EngineCore, environ: dict[str, str] | None = None) -> EngineCore:
        folder = (os.environ if environ is None else environ).get(STEP_TRACE_ENV)
        if not folder:
            return engine
        path = Path(folder)
        try:  # a benchmark's aid: a folder it cannot write never costs the model its load
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("%s=%s: no step trace (%s)", STEP_TRACE_ENV, folder, exc)
            return engine
        return cast("EngineCore", cls(engine, path / f"steps-{os.getpid()}.jsonl"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def has_work(self) -> bool:
        return self._engine.has_work

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = self._engine.abort(request_ids)
        if not self._engine.has_work:  # no step may follow (a drain, the last client gone)
            self.flush()
        return outputs

    def step(self) -> list[RequestOutput]:
        self._backend_s = self._insert_s = 0.0
        self._inserted = 0
        self._masked = None
        shapes = len(self._decode.row_counts) if self._decode is not None else 0
        waited = self._batch.waited_s if self._batch is not None else 0.0
        before = self._batch_counts()
        switched = switches()
        wall, start, cpu = time.time(), time.perf_counter(), time.thread_time()
        outputs = self._engine.step()
        took, cpu = time.perf_counter() - start, time.thread_time() - cpu
        now = switches()
        moved = (
            (now[0] - switched[0], now[1] - switched[1])
            if now is not None and switched is not None
            else (None, None)
        )
        if self._decode is not None:
            shapes = len(self._decode.row_counts) - shapes
        counts = (
            tuple(a - b for a, b in zip(self._batch_counts(), before, strict=True))
            if self._batch is not None
            else (None, None)
        )
        # only read tokens: flushed with no prompt run (a row that joined an idle batch has
        # its first token read by the step that prefilled it: `early_first`)
        ahead = int(self._batch.flushed and not counts[0]) if self._batch is not None else None
        self._rows.append(
            [
                round(wall, 6),
                round(took * 1e3, 3),
                round(self._backend_s * 1e3, 3),
                self._inserted,
                round(self._insert_s * 1e3, 3),
                len(self._engine.by_uid),
                len(outputs),
                None if ahead else self._masked,
                shapes,
                round((self._batch.waited_s - waited) * 1e3, 3)
                if self._batch is not None
                else None,
                ahead,
                *self._batch_shape(),
                *counts,
                round(cpu * 1e3, 3),
                *moved,
                round(mx.get_cache_memory() / MiB, 1),
                None,  # settle_ms: settle fills it
            ]
        )
        if len(self._rows) > FLUSH_EVERY:
            self.flush(keep=1)  # the last line waits for its settle
        return outputs

    def settle(self) -> None:
        """The engine's settle, timed into the last step's line where it had work, with the
        batch's shape after it; the lines go out when the engine has no more work."""
        if getattr(self._engine, "unsettled", None) is None:
            self._engine.settle()  # nothing put off: the line keeps None
        else:
            start = time.perf_counter()
            self._engine.settle()
            took = time.perf_counter() - start
            if self._rows and self._rows[-1][SETTLE] is None:
                row = self._rows[-1]
                row[SETTLE] = round(took * 1e3, 3)
                row[BATCH_ROWS], row[KV_SIZE] = self._batch_shape()
        if not self._engine.has_work:
            self.flush()

    def _batch_shape(self) -> tuple[int | None, int | None]:
        batch = self._batch
        if batch is None:
            return None, None
        return len(batch.rows), batch.caches[0].size() if batch.caches else 0

    def _batch_counts(self) -> tuple[int, int]:
        batch = self._batch
        return (batch.prefilled, batch.joined) if batch is not None else (0, 0)

    def flush(self, keep: int = 0) -> None:
        """Write the lines out, all but the last `keep`."""
        done = self._rows[: len(self._rows) - keep]
        if not done:
            return
        try:
            with self._path.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in done)
        except OSError as exc:  # a full disk drops the trace, never a request
            log.warning("step trace %s: %s; lines dropped", self._path, exc)
        del self._rows[: len(done)]
