"""Guide: a thinking budget that forces the think block's end marker, then the grammar over
the answer; and Masks.apply, the mask as plain MLX ops on the logits."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.types import OutputFormat, ResponseFormat
from worker.structured.grammars import json_grammar, response_grammar
from worker.structured.guide import Grammars, Guide, Masks

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(hermes_model_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(hermes_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer: TokenizerWrapper) -> Grammars:
    return Grammars(tokenizer)


@pytest.fixture(scope="module")
def grammar() -> str:
    text = response_grammar(ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, strict=True))
    assert text is not None
    return text


def encode(tokenizer: TokenizerWrapper, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def allowed(bitmask: np.ndarray, row: int = 0) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return {int(i) for i in np.flatnonzero(bits)}


def step(guide: Guide, rows: int = 1, row: int = 0) -> set[int] | None:
    """This step's allowed tokens (None: nothing forbidden)."""
    bitmask = guide.bitmask(rows)
    if not guide.fill(bitmask, row):
        assert (bitmask == -1).all()  # untouched
        return None
    return allowed(bitmask, row)


def test_budget_forces_the_end_marker_token_by_token_then_the_grammar_applies(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    end = tuple(encode(tokenizer, "</think>\n"))  # a marker of several tokens
    assert len(end) >= 2
    guide = Guide(grammars.matcher(grammar), True, end, 3, words=grammars.words)
    assert guide.constrains and guide.thinking
    for token in encode(tokenizer, "hmm well")[:3]:
        assert step(guide) is None  # within the budget: anything goes
        guide.consume(token)
    for token in end:
        assert step(guide) == {token}
        guide.consume(token)
    assert not guide.thinking
    first = step(guide)  # the answer: the grammar decides
    assert first is not None
    assert encode(tokenizer, "{")[0] in first
    assert not first & set(encode(tokenizer, "[hmm"))
    answer = encode(tokenizer, json.dumps({"answer": 42}))
    for token in answer:
        mask = step(guide)
        assert mask is not None and token in mask
        guide.consume(token)
    assert guide.error is None
    assert guide.stopped


def test_thinking_without_budget_is_never_masked(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    end = tuple(encode(tokenizer, "</think>"))
    guide = Guide(grammars.matcher(grammar), True, end, None, words=grammars.words)
    for token in encode(tokenizer, "a long think about [everything] " * 5):
        assert step(guide) is None
        guide.consume(token)
    assert not guide.stopped  # the grammar waits while thinking
    for token in end:
        guide.consume(token)
    assert not guide.thinking
    assert step(guide) is not None


def test_thinking_that_ends_within_the_budget_is_not_forced(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    end = tuple(encode(tokenizer, "</think>"))
    guide = Guide(grammars.matcher(grammar), True, end, 100, words=grammars.words)
    for token in encode(tokenizer, "short") + list(end):
        assert step(guide) is None
        guide.consume(token)
    assert not guide.thinking
    mask = step(guide)
    assert mask is not None and encode(tokenizer, "{")[0] in mask


def test_budget_of_zero_forces_the_end_at_once(tokenizer: TokenizerWrapper) -> None:
    end = tuple(encode(tokenizer, "</think>"))
    guide = Guide(None, True, end, 0, words=(len(tokenizer) + 31) // 32)
    assert step(guide) == {end[0]}
    guide.consume(end[0])
    assert not guide.thinking
    assert step(guide) is None  # no grammar: the answer is free
    assert not guide.stopped


def test_start_tokens_open_a_think_block_later(tokenizer: TokenizerWrapper) -> None:
    start = tuple(encode(tokenizer, "<think>"))
    end = tuple(encode(tokenizer, "</think>"))
    words = (len(tokenizer) + 31) // 32
    guide = Guide(None, False, end, 2, start_tokens=start, words=words)
    assert not guide.thinking and guide.start_tokens == start
    for token in encode(tokenizer, "Let me think. "):
        assert step(guide) is None
        guide.consume(token)
    assert guide.spent == 0  # the budget counts from the block's start
    for token in start:
        guide.consume(token)
    assert guide.thinking
    for token in encode(tokenizer, "hm ok")[:2]:
        assert step(guide) is None
        guide.consume(token)
    assert step(guide) == {end[0]}
    guide.consume(end[0])
    assert not guide.thinking
    assert step(guide) is None


def test_under_a_grammar_a_think_block_may_open_the_output_only(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    """A model that opens its think block itself (Qwen3's template leaves it to the model)
    may do so as its first token; the budget counts from there and the grammar waits."""
    (start,) = encode(tokenizer, "<think>")
    (end,) = encode(tokenizer, "</think>")
    guide = Guide(grammars.matcher(grammar), False, (end,), 2, (start,), grammars.words)
    assert guide.start_tokens == () and guide.opening == start
    first = step(guide)
    assert first is not None and start in first and len(first) > 1  # or the grammar's
    guide.consume(start)
    assert guide.thinking and guide.opening is None
    for token in encode(tokenizer, "hm ok")[:2]:
        assert step(guide) is None
        guide.consume(token)
    assert step(guide) == {end}  # the budget
    guide.consume(end)
    for token in encode(tokenizer, json.dumps({"answer": 4})):
        allowed_now = step(guide)
        assert allowed_now is not None and token in allowed_now and start not in allowed_now
        guide.consume(token)
    assert guide.error is None and guide.stopped


def test_under_a_grammar_a_think_block_cannot_open_after_the_first_token(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    (start,) = encode(tokenizer, "<think>")
    (end,) = encode(tokenizer, "</think>")
    guide = Guide(grammars.matcher(grammar), False, (end,), None, (start,), grammars.words)
    guide.consume(encode(tokenizer, "{")[0])
    assert guide.opening is None and not guide.thinking
    later = step(guide)
    assert later is not None and start not in later
    closed = Guide(grammars.matcher(grammar), False, (end,), None, (), grammars.words)
    assert closed.opening is None  # no marker given: the prompt settled it (preprocess)
    inside = Guide(grammars.matcher(grammar), True, (end,), None, (start,), grammars.words)
    assert inside.opening is None  # already inside: nothing to open


def test_under_a_tools_grammar_no_call_starts_inside_the_think_block(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    """There a call would escape the grammar: its marker is forbidden while thinking (and
    only it), allowed again after the block, where the grammar holds it."""
    (end,) = encode(tokenizer, "</think>")
    (marker,) = encode(tokenizer, "<tool_call>")
    words = grammars.words
    guide = Guide(grammars.matcher(grammar), True, (end,), None, words=words, call_marker=marker)
    inside = step(guide)
    assert inside is not None and marker not in inside and end in inside
    assert len(inside) == 32 * words - 1  # every other token of the row
    guide.consume(end)
    assert not guide.thinking
    plain = Guide(None, True, (end,), None, words=words, call_marker=marker)
    assert plain.call_marker is None and step(plain) is None  # no grammar: nothing to hold


def test_no_end_marker_means_no_thinking() -> None:
    guide = Guide(None, thinking=True, end_tokens=(), budget=5, words=4)
    assert not guide.thinking
    assert guide.constrains  # the budget still marks it as constrained
    assert step(guide) is None


def test_nothing_to_constrain() -> None:
    guide = Guide(None, words=4)
    assert not guide.constrains
    assert not guide.stopped
    guide.consume(7)
    assert step(guide) is None and guide.error is None


def test_a_refused_token_is_an_error(
    tokenizer: TokenizerWrapper, grammars: Grammars, grammar: str
) -> None:
    guide = Guide(grammars.matcher(grammar), words=grammars.words)
    guide.consume(encode(tokenizer, "{")[0])
    assert guide.error is None
    bad = encode(tokenizer, "]")[0]
    mask = step(guide)
    assert mask is not None and bad not in mask
    guide.consume(bad)
    assert guide.error
    first = guide.error
    assert step(guide) is None  # an errored grammar masks nothing more
    guide.consume(bad)
    assert guide.error == first  # the first error is kept


def test_fill_touches_its_row_only(grammars: Grammars, grammar: str) -> None:
    guide = Guide(grammars.matcher(grammar), words=grammars.words)
    bitmask = guide.bitmask(3)
    assert bitmask.shape == (3, grammars.words) and bitmask.dtype == np.int32
    assert guide.fill(bitmask, 1)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    assert 0 < len(allowed(bitmask, 1)) < grammars.tokenizer.vocab_size


def test_forced_token_in_a_row_of_a_batch() -> None:
    end = (40, 63, 64)  # bits 8 and 31 of word 1, bit 0 of word 2
    guide = Guide(None, True, end, 0, words=3)
    for token in end:
        bitmask = guide.bitmask(2)
        assert guide.fill(bitmask, 1)
        assert allowed(bitmask, 1) == {token}
        assert (bitmask[0] == -1).all()
        guide.consume(token)


def test_forcing_continues_a_marker_the_model_began() -> None:
    end = (40, 41, 42)
    guide = Guide(None, True, end, 2, words=2)
    guide.consume(7)
    guide.consume(40)  # the model starts the end marker as the budget runs out
    assert step(guide) == {41}


# ---- Masks.apply ---------------------------------------------------------------------------------


def mask_of(rows: list[set[int]], words: int) -> np.ndarray:
    bitmask = np.zeros((len(rows), words), dtype=np.int32)
    view = bitmask.view(np.uint32)
    for r, tokens in enumerate(rows):
        for t in tokens:
            view[r, t >> 5] |= np.uint32(1 << (t & 31))
    return bitmask


def check(logits: mx.array, out: mx.array, rows: list[set[int]]) -> None:
    got = np.array(out.astype(mx.float32))
    want = np.array(logits.astype(mx.float32))
    assert out.shape == logits.shape and out.dtype == logits.dtype
    for r, tokens in enumerate(rows):
        for t in range(logits.shape[1]):
            if t in tokens:
                assert got[r, t] == want[r, t]
            else:
                assert got[r, t] == -np.inf


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_masked_logits_are_minus_infinity(dtype: mx.Dtype) -> None:
    vocab = 64
    logits = (mx.arange(2 * vocab).reshape(2, vocab) - 50).astype(dtype)
    rows = [{0, 5, 31, 32, 63}, {17}]
    out = Masks().apply(logits, mask_of(rows, 2))
    check(logits, out, rows)


def test_a_bitmask_narrower_than_the_vocab_forbids_the_rest() -> None:
    # the model's embedding has more rows than the tokenizer's vocabulary
    logits = mx.ones((1, 40))
    rows = [{1, 31}]
    out = Masks().apply(logits, mask_of(rows, 1))
    check(logits, out, rows)
    assert np.isinf(np.array(out)[0, 32:]).all()


def test_a_bitmask_wider_than_the_vocab_is_cut() -> None:
    logits = mx.zeros((2, 20))
    rows = [{0, 19}, {3}]
    wide = mask_of([{0, 19, 20, 45}, {3, 63}], 2)
    check(logits, Masks().apply(logits, wide), rows)


def test_all_allowed_changes_nothing() -> None:
    logits = mx.random.normal((3, 70), key=mx.random.key(0))
    out = Masks().apply(logits, np.full((3, 3), -1, dtype=np.int32))
    assert mx.array_equal(out, logits).item()


def test_the_forced_token_is_the_argmax(tokenizer: TokenizerWrapper) -> None:
    vocab = len(tokenizer)
    end = tuple(encode(tokenizer, "</think>"))
    guide = Guide(None, True, end, 0, words=(vocab + 31) // 32)
    bitmask = guide.bitmask(1)
    guide.fill(bitmask, 0)
    logits = mx.random.normal((1, vocab), key=mx.random.key(1))
    assert mx.argmax(Masks().apply(logits, bitmask), axis=-1).item() == end[0]


def test_masks_of_some_rows_leave_the_others_alone() -> None:
    """The packed form (the rows' indices, then their bits, one device array)."""
    logits = mx.random.normal((4, 64), key=mx.random.key(2))
    masks = [{0, 5}, {63}]
    out = Masks().apply(logits, mask_of(masks, 2), rows=[3, 1])
    check(logits[mx.array([3, 1])], out[mx.array([3, 1])], masks)
    for r in (0, 2):
        assert mx.array_equal(out[r], logits[r]).item()


def test_settle_records_the_state_the_engine_reads(grammars: Grammars, grammar: str) -> None:
    """What the engine reads is the state when settled, not the live one a token ahead."""
    guide = Guide(grammars.matcher(grammar), words=grammars.words)
    tokens = encode(grammars.hf, json.dumps({"answer": 7}))
    for token in tokens:
        guide.consume(token)
    assert guide.stopped and not guide.done  # not settled yet
    guide.settle()
    assert guide.done and guide.failure is None
    guide.consume(tokens[0])  # not allowed after the end
    assert guide.error and guide.failure is None
    guide.settle()
    assert guide.failure == guide.error


def test_grammars_compile_on_a_thread_of_their_own_once_per_text(
    tokenizer: TokenizerWrapper,
) -> None:
    woken: list[str] = []
    grammars = Grammars(
        tokenizer, on_compiled=lambda: woken.append(threading.current_thread().name)
    )
    text = json_grammar({"type": "object", "properties": {"x": {"type": "integer"}}}, "f", True)
    future = grammars.compile(text)
    assert grammars.compile(text) is future  # asked again while compiling: the same compile
    proto = future.result(timeout=60)
    assert woken == ["grammar"]  # the engine's wake, from the grammar thread
    assert grammars.compile(text).done() and grammars.matcher(text) is not proto  # a copy
    bad = grammars.compile("start: undefined_rule\n")
    with pytest.raises(ValueError):
        bad.result(timeout=60)
    assert grammars.compile("start: undefined_rule\n") is bad  # it fails the same way again
    guide = Guide(None, compiling=grammars.compile(text), words=grammars.words)
    assert guide.ready() and guide.matcher is not None and guide.compiling is None


def test_the_grammar_thread_outlives_any_failure_of_a_compile(
    tokenizer: TokenizerWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a Rust panic reaches Python as a BaseException: the request fails, the thread goes on
    grammars = Grammars(tokenizer)
    built = Grammars._build

    def panics(self: Grammars, grammar: str) -> object:
        if "panic" in grammar:
            raise BaseException("llguidance panicked")
        return built(self, grammar)

    monkeypatch.setattr(Grammars, "_build", panics)
    with pytest.raises(ValueError, match="llguidance failed"):
        grammars.compile('start: "panic"\n').result(timeout=60)
    assert grammars.compile('start: "fine"\n').result(timeout=60) is not None


def test_a_small_schema_compiles_while_a_large_one_still_does(
    tokenizer: TokenizerWrapper,
) -> None:
    grammars = Grammars(tokenizer)
    large = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}
    slow = grammars.compile(json_grammar(large, "f", True))
    small = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fast = grammars.compile(json_grammar(small, "f", True))
    fast.result(timeout=60)
    assert not slow.done()  # (one compile thread: it would wait for all of the large one)
    slow.result(timeout=120)
