"""A request's guide over its next tokens: a grammar its answer must follow (llguidance)
and a thinking budget. The batch asks each constrained row for its mask before sampling
and hands it every token the row produced; rows without a guide are left alone.

The rows batch does that on a thread of its own, a step ahead of the engine (see
worker/backends/rows.py): what the engine reads (`done`, `failure`) is what `settle()`
recorded when the batch returned the token, not the live state of a guide that may already
have taken the next token.

Thinking comes first: while the row is inside its think block the grammar waits (the
budget, if any, counts those tokens and then forces the block's end marker); from the
token after the marker on, the grammar decides. A model that opens its think block itself
may do so as the first token of its output, grammar or not. Under a grammar that holds
tool calls, none starts inside the think block: the grammar could not hold it there.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

log = logging.getLogger("worker")

# Grammar compiles running at once (Grammars): a small schema is not held behind a large one.
COMPILE_THREADS = 2

# llguidance's first line when a parse reaches one of its limits (a row's Earley items, the
# grammar's symbols, the lexer's states or fuel): the schema asks too much of it. (Its
# message goes on with the parser's state and the whole grammar: not for the match.)
_LIMIT = re.compile(
    r"; max is \d+|too big \(limit for this grammar|Too many items \(limit|lexer_fuel"
)


def first_line(error: str) -> str:
    """llguidance's message without the parser state and the grammar that follow it."""
    return error.strip().splitlines()[0] if error.strip() else error


def beyond_limits(error: str) -> bool:
    """The grammar failed at one of llguidance's limits (a schema too large for it, such as
    hundreds of optional properties), not at a token it did not allow."""
    return _LIMIT.search(first_line(error)) is not None


class Grammars:
    """The model's llguidance tokenizer and compiled grammars, one prototype matcher per
    grammar text (least recently used out): a request gets a copy, not a new compile.

    Compiles run on threads of their own (llguidance drops the GIL while it builds a
    matcher): a large schema takes seconds (10,000 optional properties: ~10 s), and the
    thread that prepares requests must not wait on it; two of them, so that a small schema
    is not held behind a large one. A compile's outcome is kept like a success, since the
    same text fails the same way."""

    def __init__(
        self,
        tokenizer: Any,
        capacity: int = 128,
        on_compiled: Callable[[], None] | None = None,
    ) -> None:
        eos = sorted(tokenizer.eos_token_ids) or None
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_tokenizer.to_str(), n_vocab=len(tokenizer), eos_token=eos
        )
        self.hf = tokenizer
        self.capacity = capacity
        self.on_compiled = on_compiled  # called on the compiling thread after each compile
        self._compiled: OrderedDict[str, Future[Any]] = OrderedDict()
        self._jobs: queue.SimpleQueue[tuple[str, Future[Any]]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def literal(self, text: str) -> str:
        """Fixed text (a tool-call marker) as a lark expression. llguidance treats every
        added token as special, reachable only by its id: `<tool_call>` in Qwen's vocabulary
        is `<[151657]>`, not the characters."""
        parts: list[str] = []
        pending = b""
        for token in self.hf.encode(text, add_special_tokens=False):
            if self.tokenizer.is_special_token(token):
                if pending:
                    parts.append(json.dumps(pending.decode("utf-8", "replace")))
                    pending = b""
                parts.append(f"<[{token}]>")
            else:
                pending += self.tokenizer.decode_bytes([token])
        if pending:
            parts.append(json.dumps(pending.decode("utf-8", "replace")))
        return " ".join(parts) if parts else '""'

    def compile(self, grammar: str) -> Future[Any]:
        """`grammar`'s prototype matcher, compiled on a grammar thread (in the order asked,
        COMPILE_THREADS at a time; a text asked for again shares the first compile). Its
        exception is a ValueError with llguidance's message if the grammar cannot be
        compiled. One thread calls this (the one preparing requests)."""
        future = self._compiled.get(grammar)
        if future is not None:
            self._compiled.move_to_end(grammar)
            return future
        future = self._compiled[grammar] = Future()
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)  # (a request waiting on it keeps its future)
        if len(self._threads) < COMPILE_THREADS:
            thread = threading.Thread(target=self._compiling, name="grammar", daemon=True)
            self._threads.append(thread)
            thread.start()
        self._jobs.put((grammar, future))
        return future

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher for `grammar`, waiting for its compile; ValueError with
        llguidance's message if the grammar cannot be compiled."""
        return self.compile(grammar).result().deep_copy()

    def _compiling(self) -> None:
        while True:
            grammar, future = self._jobs.get()
            try:
                future.set_result(self._build(grammar))
            except ValueError as exc:
                future.set_exception(exc)
            except BaseException as exc:  # llguidance's own failure (a Rust panic is not an
                # Exception): this request's, not the thread's, which the others wait on
                future.set_exception(ValueError(f"llguidance failed: {exc!r}"))
            try:
                if self.on_compiled is not None:
                    self.on_compiled()
            except Exception:
                log.exception("waking the engine after a grammar's compile failed")

    def _build(self, grammar: str) -> Any:
        proto = llguidance.LLMatcher(self.tokenizer, grammar)
        if proto.is_error():
            raise ValueError(proto.get_error())
        # some grammars fail only at their first mask (a `$ref` loop): that one, on a
        # copy, here, so that they are a 400 and not an empty answer
        trial = proto.deep_copy()
        llg_numpy.fill_next_token_bitmask(trial, np.zeros((1, self.words), np.int32), 0)
        if trial.is_error():
            raise ValueError(trial.get_error().splitlines()[0])
        return proto

    @property
    def words(self) -> int:
        """32-bit words of a row of the bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32


class Guide:
    __slots__ = (
        "_forcing",
        "_tail",
        "budget",
        "call_marker",
        "compile_error",
        "compiling",
        "done",
        "end_tokens",
        "error",
        "failure",
        "matcher",
        "opening",
        "param",
        "spent",
        "start_tokens",
        "thinking",
        "words",
    )

    def __init__(
        self,
        matcher: Any | None,
        thinking: bool = False,
        end_tokens: tuple[int, ...] = (),
        budget: int | None = None,
        start_tokens: tuple[int, ...] = (),
        words: int = 0,
        compiling: Future[Any] | None = None,
        param: str = "",
        call_marker: int | None = None,
    ) -> None:
        self.matcher = matcher  # llguidance.LLMatcher, or None: no grammar
        # its grammar's prototype while it compiles (Grammars.compile): see ready()
        self.compiling = compiling
        self.compile_error: str | None = None  # the grammar could not be compiled
        self.param = param  # the request's field the grammar comes from (its error names it)
        self.words = words  # of a bitmask row (Grammars.words)
        self.thinking = thinking and bool(end_tokens)  # inside the think block now
        self.end_tokens = end_tokens
        # a model may open its think block itself (a template that leaves it to the model,
        # as Qwen3's): the budget counts from there. Without a grammar, anywhere; with
        # one, as its first token only (the marker must be one token), before the grammar
        grammar = matcher is not None or compiling is not None
        self.start_tokens = start_tokens if not grammar and end_tokens else ()
        self.opening = (
            start_tokens[0]
            if grammar and end_tokens and len(start_tokens) == 1 and not self.thinking
            else None
        )
        # a grammar that holds tool calls: the marker that starts one (one token) is not
        # written inside the think block, where a call would escape the grammar
        self.call_marker = call_marker if grammar and end_tokens else None
        self.budget = budget  # thinking tokens allowed (None: no limit)
        self.spent = 0
        self.error: str | None = None
        self.done = False  # as settled: the grammar was complete after the returned token
        self.failure: str | None = None  # as settled: the error after the returned token
        self._forcing = 0  # budget spent: end marker tokens forced so far
        self._tail: list[int] = []

    def ready(self) -> bool:
        """Its grammar is compiled (or failed to: `compile_error`); until then the request
        waits for a place in the batch, and the others go ahead of it."""
        future = self.compiling
        if future is None:
            return True
        if not future.done():
            return False
        self.compiling = None
        try:
            self.matcher = future.result().deep_copy()
        except ValueError as exc:
            self.compile_error = str(exc)
        return True

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing may follow."""
        return self.matcher is not None and not self.thinking and self.matcher.is_stopped()

    def settle(self) -> None:
        """Record the state after the tokens consumed so far, for the engine to read."""
        self.done, self.failure = self.stopped, self.error

    @property
    def constrains(self) -> bool:
        grammar = self.matcher is not None or self.compiling is not None
        return grammar or self.budget is not None

    def bitmask(self, rows: int) -> np.ndarray:
        """A bitmask for `rows` rows, every token allowed."""
        return np.full((rows, self.words), -1, dtype=np.int32)

    def consume(self, token: int) -> None:
        if self.thinking:
            self.spent += 1
            if self._forcing:
                self._forcing += 1
            self._tail = [*self._tail, token][-len(self.end_tokens) :]
            if tuple(self._tail) == self.end_tokens:
                self.thinking = False
            return
        if self.start_tokens:
            self._tail = [*self._tail, token][-len(self.start_tokens) :]
            if tuple(self._tail) == self.start_tokens:
                self.thinking, self._tail = True, []
            return
        if self.opening is not None:
            opened, self.opening = token == self.opening, None
            if opened:
                self.thinking = True
                return
        matcher = self.matcher
        if matcher is not None and self.error is None and not matcher.consume_token(token):
            self.error = matcher.get_error() or f"token {token} was not allowed"

    def fill(self, bitmask: np.ndarray, row: int) -> bool:
        """This step's allowed tokens into bitmask[row]; False: none forbidden."""
        if self.thinking:
            if self.budget is None or self.spent < self.budget:
                if self.call_marker is None:
                    return False
                token = self.call_marker
                bitmask[row] = -1
                bitmask.view(np.uint32)[row, token >> 5] &= ~np.uint32(1 << (token & 31))
                return True
            if not self._forcing:  # continue a marker the model began, if it did
                self._forcing = 1 + _begun(self._tail, self.end_tokens)
            token = self.end_tokens[min(self._forcing - 1, len(self.end_tokens) - 1)]
            bitmask[row] = 0
            bitmask.view(np.uint32)[row, token >> 5] = np.uint32(1 << (token & 31))
            return True
        if self.matcher is None or self.error is not None:
            return False
        llg_numpy.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.opening is not None:  # or the think block the model may open first
            token = self.opening
            bitmask.view(np.uint32)[row, token >> 5] |= np.uint32(1 << (token & 31))
        return True


def _begun(tail: list[int], marker: tuple[int, ...]) -> int:
    """How many of the marker's first tokens the tail ends with (not the whole marker)."""
    for k in range(min(len(tail), len(marker) - 1), 0, -1):
        if tuple(tail[-k:]) == marker[:k]:
            return k
    return 0


class Masks:
    """A batch's masks for one step: the guided rows' bitmask, filled row by row
    (llguidance's parallel executor was measured slower, on 2 cores and on the H200's
    host), applied to the logits with one gather from a table kept per dtype."""

    def __init__(self) -> None:
        self._tables: dict[Any, Any] = {}

    def fill(self, guides: list[Guide]) -> tuple[np.ndarray, list[bool]]:
        """(bitmask, filled): row j is guides[j]'s; filled[j] False: it forbids nothing."""
        bitmask = guides[0].bitmask(len(guides))
        return bitmask, [g.fill(bitmask, j) for j, g in enumerate(guides)]

    def apply(self, logits: Any, bitmask: np.ndarray, rows: list[int] | None = None) -> Any:
        """logits (batch, vocab) with every token whose bit is clear in `bitmask` (one row
        of 32-bit words, llguidance's layout, per masked row) set to -inf: of every row, or
        of `rows` only (bitmask[j] masks logits[rows[j]]). Plain MLX ops, so any device."""
        return self.apply_packed(logits, pack(bitmask, rows))

    def apply_packed(self, logits: Any, packed: Packed) -> Any:
        """`apply` with the masks already on the device (`pack`, which another thread may
        run: making an array from host memory is a good part of a mask's host time)."""
        import mlx.core as mx

        table = self._tables.get(logits.dtype)
        if table is None:
            table = self._tables[logits.dtype] = _byte_table(logits.dtype)
        vocab = logits.shape[-1]
        masked, words, lead = packed.masked, packed.words, packed.lead
        bits = mx.view(packed.data[lead:] if lead else packed.data, mx.uint8)
        add = table[bits].reshape(masked, words * 32)
        width = add.shape[1]
        if width < vocab:  # tokens llguidance does not know (a padded embedding): never
            pad = mx.full((masked, vocab - width), -float("inf"), dtype=add.dtype)
            add = mx.concatenate([add, pad], axis=1)
        elif width > vocab:
            add = add[:, :vocab]
        if not lead:
            return logits + add
        return logits.at[packed.data[:lead]].add(add)


class Packed:
    """Masks as one device array: the masked rows' indices (none: every row, in order),
    then their bitmask rows' words."""

    __slots__ = ("data", "lead", "masked", "words")

    def __init__(self, data: Any, lead: int, masked: int, words: int) -> None:
        self.data, self.lead, self.masked, self.words = data, lead, masked, words


def pack(bitmask: np.ndarray, rows: list[int] | None = None) -> Packed:
    """bitmask (masked, words) and the rows it masks (None: all, in order) as one array: one
    copy from the host a step, not two."""
    import mlx.core as mx

    masked, words = bitmask.shape
    if rows is None:
        return Packed(mx.array(bitmask.reshape(-1)), 0, masked, words)
    flat = np.empty(len(rows) + bitmask.size, dtype=np.int32)
    flat[: len(rows)] = rows
    flat[len(rows) :] = bitmask.reshape(-1)
    return Packed(mx.array(flat), len(rows), masked, words)


def _byte_table(dtype: Any) -> Any:
    """(256, 8): bit b of byte value v clear -> -inf at [v, b], else 0 (little-endian bits,
    as llguidance packs them)."""
    import mlx.core as mx

    values = np.arange(256, dtype=np.uint8)[:, None]
    bits = (values >> np.arange(8, dtype=np.uint8)) & 1
    table = np.where(bits == 1, 0.0, -np.inf).astype(np.float32)
    return mx.array(table).astype(dtype)
