"""worker/backends/groups.py: rows prefilled together, and their first tokens taken from their
own prefill (engine.first_token = "prefill") on a real tiny model: the same tokens and
distributions as mlx-lm's, a step sooner."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import pytest

from shared.config import EngineOptions
from tests.engine_fixtures import Loaded, insert_greedy, reference_greedy, run_steps
from worker.backends import groups
from worker.backends.groups import first_token
from worker.backends.mlx_lm import make_backend
from worker.backends.rows import RowBatch


class Doubled:
    """A model whose forward pass is more than its head over its hidden states."""

    def __init__(self, model: Any) -> None:
        self.wrapped, self.model, self.model_type = model, model.model, model.model_type
        self.lm_head = model.lm_head

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        return 2 * self.wrapped(tokens, cache=cache)


class Rounded:
    """A model whose forward pass over several positions rounds otherwise than a decode
    step's, as a GPU's kernels do (its logits there off by `by`), and whose head, as the
    first token's way reads it, off by `head`."""

    def __init__(self, model: Any, by: float = 0.1, head: float = 0.0) -> None:
        self.wrapped, self.model, self.model_type = model, model.model, model.model_type
        self.lm_head = lambda h: model.lm_head(h) + head
        self.by = by

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        out = self.wrapped(tokens, cache=cache)
        return out + self.by if tokens.shape[1] > 1 else out


class Recorded:
    """A layer that records its queries' positions."""

    def __init__(self, layer: Any, lengths: list[int]) -> None:
        self.layer, self.lengths = layer, lengths

    def __call__(self, h: mx.array, mask: Any, cache: Any) -> mx.array:
        self.lengths.append(h.shape[1])
        return self.layer(h, mask, cache)


def test_known_models_only_and_only_where_the_probe_agrees(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    assert first_token(chat.model) is not None
    other = type("Other", (), {"model_type": "gemma3", "model": chat.model.model})()
    assert first_token(other) is None
    assert first_token(Doubled(chat.model)) is None
    assert "other logits" in caplog.text
    assert "row 1 of 1: logits off by up to" in caplog.text  # how far, for a GPU's log
    assert "mlx-lm's own first token's by" in caplog.text


def test_the_probe_takes_a_backends_rounding_as_its_yardstick(chat: Loaded) -> None:
    """Off by more than the tolerance, but no more than twice as far as mlx-lm's own first
    token: the model's logits as this backend rounds them. More than twice, or a yardstick
    past a rounding's size (2 % of the largest logit, here about 29): refused."""
    # the first token's way reads the head's output, off by `head`; the whole prompt's
    # logits are off by `by`, mlx-lm's own first token (a decode step) is not
    assert first_token(Rounded(chat.model)) is not None  # off 0.1, mlx-lm's 0.1
    assert first_token(Rounded(chat.model, head=0.25)) is not None  # 0.15: within 0.2
    assert first_token(Rounded(chat.model, head=0.35)) is None  # 0.25: past 0.2
    assert first_token(Rounded(chat.model, by=3.0)) is None  # mlx-lm's own 3: no yardstick


def test_auto_takes_them_from_the_prefill_on_mlx_cuda_and_cpu_not_metal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert groups.wanted("prefill") and not groups.wanted("step")
    assert groups.wanted("auto")  # this machine: MLX's CPU
    monkeypatch.setattr(groups, "on_cpu", lambda: False)
    monkeypatch.setattr(groups, "on_cuda", lambda: False)  # Metal: not measured
    assert not groups.wanted("auto") and groups.wanted("prefill")
    monkeypatch.setattr(groups, "on_cuda", lambda: True)
    assert groups.wanted("auto") and not groups.wanted("step")


def test_a_rows_first_token_comes_out_of_the_step_that_prefilled_it(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model, first=first_token(chat.model))
    (lone,) = insert_greedy(batch, chat, [prompts[0]])
    out = batch.step()
    assert [uid for uid, _, _ in out] == [lone]
    tokens = {lone: [out[0][1]]}
    run_steps(batch, 3, tokens)
    (joiner,) = insert_greedy(batch, chat, [prompts[1]])
    out = batch.step()  # the running row's next token and the joiner's first, together
    assert sorted(uid for uid, _, _ in out) == sorted([lone, joiner])
    for uid, token, _ in out:
        tokens.setdefault(uid, []).append(token)
    run_steps(batch, 6, tokens)
    assert tokens[lone][:10] == reference_greedy(chat.model, prompts[0], 10)
    assert tokens[joiner][:6] == reference_greedy(chat.model, prompts[1], 6)
    # what a row holds is what its KV holds: its prompt and every token fed back since
    kept = batch.extract([joiner])[joiner]
    cache, held = kept
    assert held[: len(prompts[1])] == prompts[1]
    assert [c.size() for c in cache.caches()] == [len(held)] * len(batch.caches)


def test_early_a_row_joining_an_idle_batch_is_read_before_the_next_step_is_built(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """`early_first`: the step that prefilled a lone row returns its first token (and its
    distribution) without building the next step (its KV is the prompt's alone), the next
    call builds it; a row joining a running batch is read as before, with the running row's
    token. Tokens as mlx-lm's."""
    batch = RowBatch(chat.model, first=first_token(chat.model), early_first=True)
    (lone,) = insert_greedy(batch, chat, [prompts[0]])
    [(uid, token, lines)] = batch.step()
    assert uid == lone and lines is not None and int(mx.argmax(lines)) == token
    assert [c.size() for c in batch.caches] == [len(prompts[0])] * len(batch.caches)
    assert batch.step() == []  # the next step built, its token read by the call after
    assert [c.size() for c in batch.caches] == [len(prompts[0]) + 1] * len(batch.caches)
    tokens = {lone: [token]}
    run_steps(batch, 3, tokens)
    (joiner,) = insert_greedy(batch, chat, [prompts[1]])
    out = batch.step()  # not idle: the running row's next token and the joiner's first
    assert sorted(uid for uid, _, _ in out) == sorted([lone, joiner])
    assert not batch.flushed  # read once the next step was built, as every later token
    for uid, token, _ in out:
        tokens.setdefault(uid, []).append(token)
    run_steps(batch, 6, tokens)
    assert tokens[lone][:10] == reference_greedy(chat.model, prompts[0], 10)
    assert tokens[joiner][:6] == reference_greedy(chat.model, prompts[1], 6)
    kept = batch.extract([joiner])[joiner]  # what it holds is what its KV holds
    assert [c.size() for c in kept[0].caches()] == [len(kept[1])] * len(batch.caches)


@pytest.mark.parametrize("chunk", [2048, 8], ids=["one-chunk", "chunks"])
def test_early_a_row_joining_the_call_after_an_early_read_waits_for_its_step(
    chat: Loaded, prompts: list[list[int]], chunk: int
) -> None:
    """A row that would join in the call right after an early read (it arrived meanwhile,
    or its group took more chunks than the lone row's) joins once the early row's next
    step is built: every first token comes out, and what a row holds is what its KV holds."""
    batch = RowBatch(
        chat.model, prefill_step_size=chunk, first=first_token(chat.model), early_first=True
    )
    if chunk == 8:  # arriving together, the longer prompt's group takes one chunk more
        chosen = [prompts[0], prompts[3]]
        assert -(-len(chosen[1]) // 8) == -(-len(chosen[0]) // 8) + 1
        uids = insert_greedy(batch, chat, chosen)
    else:  # the second arrives right after the first's early read
        chosen = [prompts[0], prompts[2]]
        uids = insert_greedy(batch, chat, chosen[:1])
    tokens: dict[int, list[int]] = {}
    while not tokens:  # the first row's prefill chunks, then its early read
        run_steps(batch, 1, tokens)
    assert batch.flushed and list(tokens) == uids[:1]
    if chunk != 8:
        uids += insert_greedy(batch, chat, chosen[1:])
    run_steps(batch, 30, tokens)
    for uid, prompt in zip(uids, chosen, strict=True):
        assert tokens[uid][:6] == reference_greedy(chat.model, prompt, 6), len(prompt)
        cache, held = batch.extract([uid])[uid]
        assert -1 not in held and held[: len(prompt)] == prompt
        assert [c.size() for c in cache.caches()] == [len(held)] * len(batch.caches)


def test_early_where_first_tokens_come_from_a_step_is_a_warning(
    chat: Loaded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """first_token = "auto" where it keeps mlx-lm's way (Metal): nothing to read early,
    said so at load; where first tokens come from the prefill, nothing said."""
    options = EngineOptions(batcher="rows", first_token_read="early")
    with caplog.at_level(logging.WARNING):
        backend = make_backend(chat.model, chat.tokenizer, options)
    assert backend.batch.early_first and backend.batch.first is not None  # type: ignore[attr-defined]
    assert "no effect here" not in caplog.text
    monkeypatch.setattr(groups, "wanted", lambda setting: setting == "prefill")  # Metal
    with caplog.at_level(logging.WARNING):
        backend = make_backend(chat.model, chat.tokenizer, options)
    assert backend.batch.first is None  # type: ignore[attr-defined]
    assert "engine.first_token_read = 'early': no effect here" in caplog.text


def test_pipelined_a_lone_rows_next_step_is_built_before_its_first_token_is_read(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model, first=first_token(chat.model))
    (lone,) = insert_greedy(batch, chat, [prompts[0]])
    assert [uid for uid, _, _ in batch.step()] == [lone]
    assert [c.size() for c in batch.caches] == [len(prompts[0]) + 1] * len(batch.caches)


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_rows_of_different_lengths_over_several_chunks_give_mlx_lms_tokens(
    chat: Loaded, prompts: list[list[int]], buckets: bool
) -> None:
    """Right-padded rows (and with prefill buckets, padding after the longest): each row's
    first token comes from its own last position, not the group's."""
    batch = RowBatch(
        chat.model, prefill_step_size=8, prefill_buckets=buckets, first=first_token(chat.model)
    )
    chosen = sorted(prompts, key=len)[-4:]  # several chunks each, of different lengths
    assert len({len(p) for p in chosen}) > 1 and min(len(p) for p in chosen) > 8
    uids = insert_greedy(batch, chat, chosen)
    tokens: dict[int, list[int]] = {}
    run_steps(batch, 40, tokens)
    for uid, prompt in zip(uids, chosen, strict=True):
        assert tokens[uid][:5] == reference_greedy(chat.model, prompt, 5), len(prompt)


def test_the_first_tokens_distribution_is_the_models_at_the_prompts_end(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model, first=first_token(chat.model))
    uids = insert_greedy(batch, chat, prompts[:3])
    firsts: dict[int, mx.array] = {}
    for _ in range(3):
        for uid, _token, lp in batch.step():
            if uid not in firsts:
                assert lp is not None
                firsts[uid] = lp
    for uid, prompt in zip(uids, prompts[:3], strict=True):
        logits = chat.model(mx.array(prompt)[None])[0, -1]
        want = logits - mx.logsumexp(logits, keepdims=True)
        assert float(mx.abs(firsts[uid] - want).max()) < 1e-3


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_rows_ending_together_split_the_last_layer_and_give_mlx_lms_tokens(
    chat: Loaded, prompts: list[list[int]], buckets: bool
) -> None:
    """One row, then two rows of one length: the last layer runs over the positions before
    the last one and from it on (with buckets, the padding after it too), and its keys and
    values are all written."""
    long = max(prompts, key=len)
    twins = [long, [(t + 1) % 400 + 5 for t in long]]
    for chosen in ([long], twins):
        batch = RowBatch(
            chat.model, prefill_step_size=8, prefill_buckets=buckets, first=first_token(chat.model)
        )
        uids = insert_greedy(batch, chat, chosen)
        tokens: dict[int, list[int]] = {}
        run_steps(batch, 12, tokens)
        for uid, prompt in zip(uids, chosen, strict=True):
            assert tokens[uid][:8] == reference_greedy(chat.model, prompt, 8)
        kv, held = batch.extract(uids[:1])[uids[0]]
        assert [c.size() for c in kv.caches()] == [len(held)] * len(batch.caches)


def test_with_buckets_the_last_layer_splits_at_bucketed_lengths(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Two rows ending at 100 and 90 positions, in a chunk padded to 128: the last layer runs
    over 64 positions, then 64 (not 89, then 11), and the tokens are still mlx-lm's."""
    base = max(prompts, key=len)
    chosen = [(base * 4)[:100], (base * 4)[1:91]]
    lengths: list[int] = []
    for buckets, want in ((True, [64, 64]), (False, [89, 11])):
        first = first_token(chat.model)
        assert first is not None
        first.layers = [*first.layers[:-1], Recorded(first.layers[-1], lengths)]
        batch = RowBatch(chat.model, prefill_buckets=buckets, first=first)
        uids = insert_greedy(batch, chat, chosen)
        tokens: dict[int, list[int]] = {}
        lengths.clear()
        run_steps(batch, 6, tokens)
        assert lengths[:2] == want
        for uid, prompt in zip(uids, chosen, strict=True):
            assert tokens[uid][:5] == reference_greedy(chat.model, prompt, 5)
