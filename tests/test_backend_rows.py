"""worker/backends/rows.py: the project's own continuous batch on a real tiny model. Rows join
with their first step in the batch's, leave lazily, and decode exactly as mlx-lm does alone.
(The engine's tests run over it too: tests/test_engine*.py, the `batcher` fixture.)"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    TokenBuffer,
    make_prompt_cache,
)

from shared.config import EngineOptions
from tests.engine_fixtures import (
    Loaded,
    drive,
    insert_greedy,
    prepared,
    reference_greedy,
    run_steps,
    token_ids,
)
from worker.backends import rows as rows_module
from worker.backends.groups import first_token
from worker.backends.mlx_lm import make_backend
from worker.backends.rows import COMPACT_SHARE, MAX_GROUPS, RowBatch
from worker.backends.sampling import greedy

FIRST = {"prefill": True}


@pytest.fixture(autouse=True, params=["prefill", "step"])
def first_tokens(request: pytest.FixtureRequest) -> str:
    """Every batch here twice: rows' first tokens from their prefill (groups.py), and from
    the batch's next step after it (mlx-lm's way; the tests of the read-ahead are that
    way's alone)."""
    FIRST["prefill"] = request.param == "prefill"
    return str(request.param)


def _batch(model: Any, **kwargs: Any) -> RowBatch:
    return RowBatch(model, first=first_token(model) if FIRST["prefill"] else None, **kwargs)


def test_the_public_pieces_it_stands_on() -> None:
    for name in ("merge", "prepare", "finalize", "extend", "filter", "extract", "size"):
        assert callable(getattr(BatchKVCache, name)), name
    prepare = inspect.signature(BatchKVCache.prepare).parameters
    assert {"lengths", "right_padding"} <= set(prepare)
    assert {"keys", "values", "offset"} <= set(vars(KVCache()))
    assert TokenBuffer([1, 2]).update_and_fetch(mx.array([3])).tolist() == [1, 2, 3]


def test_rows_joining_at_different_steps_decode_as_alone(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = _batch(chat.model, prefill_step_size=4)  # several prefill chunks a prompt
    out: dict[int, list[int]] = {}
    first = insert_greedy(batch, chat, prompts[:3])
    run_steps(batch, 5, out)
    late = insert_greedy(batch, chat, prompts[3:5])
    run_steps(batch, 30, out)
    for uid, prompt in zip(first + late, prompts[:5], strict=True):
        assert out[uid][:16] == reference_greedy(chat.model, prompt, 16), uid


def test_the_next_inputs_keep_the_sampled_dtype_when_rows_join_a_running_batch(
    chat: Loaded, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Joining rows' first inputs are uint32 like sampled tokens: an int32 array joined to
    uint32 ones would promote the batch's inputs to int64 (one more gather kernel for MLX's
    CUDA backend to compile at first use, in a served step)."""
    dtypes = set()
    decode = RowBatch._decode

    def noted(self: RowBatch, want_logprobs: bool) -> Any:
        assert self.inputs is not None
        dtypes.add(self.inputs.dtype)
        return decode(self, want_logprobs)

    monkeypatch.setattr(RowBatch, "_decode", noted)
    batch = _batch(chat.model, prefill_step_size=64)
    out: dict[int, list[int]] = {}
    insert_greedy(batch, chat, prompts[:2])
    run_steps(batch, 3, out)
    insert_greedy(batch, chat, prompts[2:4])
    run_steps(batch, 6, out)
    assert len(batch.rows) == 4
    assert dtypes == {mx.uint32}


def test_a_row_that_leaves_is_dropped_lazily_and_never_seen_again(
    chat: Loaded, prompts: list[list[int]], first_tokens: str
) -> None:
    batch = _batch(chat.model)
    out: dict[int, list[int]] = {}
    uids = insert_greedy(batch, chat, prompts[:8])
    run_steps(batch, 4, out)
    assert len(batch.rows) == 8
    batch.remove([uids[0]])  # 1 of 8 left: under the share, it decodes on unseen
    run_steps(batch, 2, out)
    # tokens of steps 1-4 (the first from the prefill), or of steps 2-4
    assert len(batch.rows) == 8 and len(out[uids[0]]) == (4 if first_tokens == "prefill" else 3)
    assert not batch.holds(uids[0]) and batch.holds(uids[1])
    batch.remove(uids[1:3])  # 3 of 8 now: compacted at the next step
    assert COMPACT_SHARE <= 3 / 8
    run_steps(batch, 1, out)
    assert [r.uid for r in batch.rows] == uids[3:]
    run_steps(batch, 20, out)
    for uid, prompt in zip(uids[3:], prompts[3:8], strict=True):
        assert out[uid][:20] == reference_greedy(chat.model, prompt, 20), uid
    batch.remove(uids[3:])  # the last rows: the batch lets its KV go at once
    assert batch.rows == [] and batch.caches == [] and not batch.active
    assert batch.step() == []


def test_with_bucket_rows_rows_that_left_round_the_count_up_and_decode_unseen(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """A real batch: 33 running and 1 joining round up to 40 with 6 of the 7 rows that left
    (worker/backends/buckets.py says which may stay); the running rows decode as alone."""
    short = min(prompts, key=len)
    batch = _batch(chat.model, bucket_rows=True)
    out: dict[int, list[int]] = {}
    uids = insert_greedy(batch, chat, [short] * 40)
    run_steps(batch, 2, out)
    batch.remove(uids[:7])  # 7 of 40 left: under the share, nothing compacts yet
    late = insert_greedy(batch, chat, [short])
    run_steps(batch, 2, out)
    assert len(batch.rows) == 40 and sum(r.dead for r in batch.rows) == 6
    assert {r.uid for r in batch.rows if r.dead} <= set(uids[:7])
    run_steps(batch, 12, out)
    for uid in [*uids[7:10], *late]:
        assert out[uid][:12] == reference_greedy(chat.model, short, 12), uid
    assert all(len(out[u]) <= 2 for u in uids[:7])  # never seen after they left
    # off (the default but on MLX's CUDA backend): the same sequence drops every row that left
    plain = _batch(chat.model)
    firsts = insert_greedy(plain, chat, [short] * 40)
    run_steps(plain, 2, {})
    plain.remove(firsts[:7])
    insert_greedy(plain, chat, [short])
    run_steps(plain, 2, {})
    assert len(plain.rows) == 34 and not any(r.dead for r in plain.rows)


def test_row_buckets_are_on_for_mlx_cuda_only(
    chat: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = EngineOptions(batcher="rows", decode_step="model")
    assert make_backend(chat.model, chat.tokenizer, options).batch.bucket == 1  # type: ignore[attr-defined]
    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert make_backend(chat.model, chat.tokenizer, options).batch.bucket == 8  # type: ignore[attr-defined]
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # Metal: not measured there
    assert make_backend(chat.model, chat.tokenizer, options).batch.bucket == 1  # type: ignore[attr-defined]


def test_at_most_max_group_rows_prefill_side_by_side(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = _batch(chat.model, max_group=2)
    out: dict[int, list[int]] = {}
    uids = insert_greedy(batch, chat, prompts[:5])
    run_steps(batch, 1, out)  # two rows a group, MAX_GROUPS groups a step
    assert [r.uid for r in batch.rows] == uids[: 2 * MAX_GROUPS]
    assert len(batch.waiting) == 5 - 2 * MAX_GROUPS
    run_steps(batch, 12, out)
    assert [r.uid for r in batch.rows] == uids
    for uid, prompt in zip(uids, prompts[:5], strict=True):
        assert out[uid][:8] == reference_greedy(chat.model, prompt, 8), uid


def test_a_short_prompt_is_not_held_behind_a_long_one(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Inserted together, a long prompt (several chunks) and a short one (one chunk) are
    prefilled apart: the short one joins after one step, the long one after its chunks."""
    long, short = prompts[2] * 3, prompts[1]
    batch = _batch(chat.model, prefill_step_size=8)
    assert len(long) > 3 * 8 and len(short) <= 8
    out: dict[int, list[int]] = {}
    slow, fast = insert_greedy(batch, chat, [long, short])
    run_steps(batch, 1, out)  # the short one's group is in after its one chunk; the long one's not
    assert [r.uid for r in batch.rows] == [fast] and len(batch.groups) == 1
    run_steps(batch, 3, out)
    assert len(out[fast]) >= 2 and slow not in out
    run_steps(batch, 20, out)
    assert out[slow][:8] == reference_greedy(chat.model, long, 8)
    assert out[fast][:8] == reference_greedy(chat.model, short, 8)


@pytest.mark.parametrize("first_tokens", ["step"])
def test_a_rows_first_token_comes_out_before_the_next_groups_prefill(
    chat: Loaded, prompts: list[list[int]], first_tokens: str
) -> None:
    """A step reads its tokens at the next one; when that one has a prefill to hand over
    and a row's first token is pending, it reads them first and the prefill waits a call."""
    batch = RowBatch(chat.model)
    (first,) = insert_greedy(batch, chat, [prompts[0]])
    assert batch.step() == []  # prefilled, joined, decoded: its first token is pending
    (second,) = insert_greedy(batch, chat, [prompts[1]])
    out = batch.step()
    assert [uid for uid, _, _ in out] == [first]
    assert [w.row.uid for w in batch.waiting] == [second] and not batch.groups
    tokens = {first: [out[0][1]]}
    run_steps(batch, 8, tokens)
    assert tokens[first][:8] == reference_greedy(chat.model, prompts[0], 8)
    assert tokens[second][:6] == reference_greedy(chat.model, prompts[1], 6)
    # a running row's later tokens do not hold a prefill back
    (third,) = insert_greedy(batch, chat, [prompts[2]])
    run_steps(batch, 1, tokens)
    assert not batch.waiting and third in {r.uid for r in batch.rows}
    run_steps(batch, 6, tokens)
    assert tokens[third][:4] == reference_greedy(chat.model, prompts[2], 4)


@pytest.mark.parametrize("first_tokens", ["step"])
def test_after_a_read_ahead_held_tokens_are_those_whose_kv_is_written(
    chat: Loaded, prompts: list[list[int]], first_tokens: str
) -> None:
    """Between a call that only read the pending tokens and the next, a row's KV taken out
    (for the prefix cache) matches its tokens, and a row joining one token longer than a
    running row leaves the running row masked (its KV starts one position later)."""
    batch = RowBatch(chat.model)
    (running,) = insert_greedy(batch, chat, [prompts[0]])
    assert batch.step() == []
    n = len(prompts[0])
    longer = [(11 * i + 1) % 500 + 5 for i in range(n + 2)]  # held n + 1, as running's
    (joiner,) = insert_greedy(batch, chat, [longer])
    out = batch.step()  # read ahead: running's first token
    kv, held = batch.extract([running])[running]
    assert (
        [c.size() for c in kv.caches()]
        == [len(held)] * len(batch.caches)
        == [n] * len(batch.caches)
    )
    tokens: dict[int, list[int]] = {running: [out[0][1]]}
    logprobs: list[mx.array] = []
    for _ in range(8):
        for uid, token, lp in batch.step():
            tokens.setdefault(uid, []).append(token)
            if uid == running and lp is not None:
                logprobs.append(lp)
    assert batch.padded
    assert tokens[running][:8] == reference_greedy(chat.model, prompts[0], 8)
    assert tokens[joiner][:6] == reference_greedy(chat.model, longer, 6)
    cache = make_prompt_cache(chat.model)
    logits = chat.model(mx.array(prompts[0] + tokens[running])[None], cache=cache)[0]
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[n:]
    assert logprobs and all(
        float(mx.abs(lp - want[i]).max()) < 1e-3 for i, lp in enumerate(logprobs)
    )


def test_a_row_removed_while_prefilling_never_joins(chat: Loaded, prompts: list[list[int]]) -> None:
    batch = _batch(chat.model, prefill_step_size=2)
    out: dict[int, list[int]] = {}
    victim, other = insert_greedy(batch, chat, [prompts[2], prompts[1]])
    run_steps(batch, 1, out)
    assert batch.groups and batch.holds(victim)
    kept = batch.remove([victim], keep_caches=True)
    assert kept == {}  # nothing of it is in the batch's KV yet
    assert batch.groups  # "other" still prefills in its group
    run_steps(batch, len(prompts[2]) // 2 + 12, out)  # the group's prefill, then 10+ steps
    assert victim not in out and [r.uid for r in batch.rows] == [other]
    assert out[other][:10] == reference_greedy(chat.model, prompts[1], 10)


def test_cached_prefixes_of_different_lengths_prefill_together(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Two rows join in one group, one with 5 tokens of its prompt already in a cache: the
    group is right-padded and moved left once in, and both decode as from scratch."""
    prompt_a, prompt_b = prompts[2], prompts[3]
    cache_a = make_prompt_cache(chat.model)
    chat.model(mx.array(prompt_a[:5])[None], cache=cache_a)
    batch = _batch(chat.model)
    uids = batch.insert(
        [prompt_a[5:], prompt_b],
        [cache_a, make_prompt_cache(chat.model)],
        [prompt_a[:5], []],
        [greedy, greedy],
        [[], []],
    )
    out: dict[int, list[int]] = {}
    run_steps(batch, 14, out)
    assert out[uids[0]][:12] == reference_greedy(chat.model, prompt_a, 12)
    assert out[uids[1]][:12] == reference_greedy(chat.model, prompt_b, 12)
    kv, held = batch.extract([uids[0]])[uids[0]]
    assert held[: len(prompt_a)] == prompt_a and all(c.size() == len(held) for c in kv.caches())


def test_steps_without_logprobs_give_the_same_tokens_and_no_rows(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    with_rows, without = _batch(chat.model), _batch(chat.model)
    a, b = insert_greedy(with_rows, chat, prompts[:3]), insert_greedy(without, chat, prompts[:3])
    got: dict[int, list[int]] = {}
    want: dict[int, list[int]] = {}
    for _ in range(8):
        for uid, token, row in without.step(logprobs=False):
            assert row is None
            got.setdefault(uid, []).append(token)
        for uid, token, row in with_rows.step():
            assert row is not None and row.shape == (chat.model.args.vocab_size,)
            want.setdefault(uid, []).append(token)
    assert [got[u] for u in b] == [want[u] for u in a] and all(got[u] for u in b)


def test_a_model_with_other_caches_is_refused_by_name(chat: Loaded) -> None:
    """Sliding-window (and state-space) layers keep caches the rows batch does not merge:
    such a model fails to load on it with the fix in the message, never decodes wrongly."""

    class SlidingWindow:
        layers = chat.model.layers

        def make_cache(self) -> list[object]:
            return [RotatingKVCache(max_size=64) for _ in self.layers]

    with pytest.raises(ValueError, match=r"RotatingKVCache.*batcher = 'mlx_lm'"):
        make_backend(SlidingWindow(), chat.tokenizer, EngineOptions(batcher="rows"))
    # the default takes the rows batch where it can, BatchGenerator elsewhere
    assert EngineOptions().batcher == "auto"
    assert make_backend(SlidingWindow(), chat.tokenizer, EngineOptions()).batcher == "mlx_lm"
    assert make_backend(chat.model, chat.tokenizer, EngineOptions()).batcher == "rows"
    settled = make_backend(chat.model, chat.tokenizer, EngineOptions(join_settle_steps=3))
    assert settled.batch.settle_steps == 3  # type: ignore[attr-defined]


def test_both_batches_give_the_same_tokens_under_every_sampling_option(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Seeded sampling, nucleus and top-k filters, penalties (which read each row's token
    history), logit bias and min_tokens: the same requests, side by side, on either batch."""
    options: list[dict[str, object]] = [
        {"temperature": 0.8, "seed": 7},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3},
        {"temperature": 0.0, "repetition_penalty": 1.3},
        {"temperature": 0.0, "presence_penalty": 0.8, "frequency_penalty": 0.5},
        {"temperature": 0.0, "logit_bias": {5: 3.0}},
        {"temperature": 0.0, "min_tokens": 6, "logit_bias": {2: 50.0}},
        {"temperature": 0.0},
    ]
    # A token outside the prompt, biased far above the rest: greedy repeats it for ever, unless
    # a penalty over the row's generated tokens takes it back after its first appearance.
    prompt = prompts[0]
    logits = chat.model(mx.array(prompt)[None])[0, -1]
    outside = next(t for t in range(3, 300) if t not in prompt)
    bias = {outside: float(logits.max().item() - logits[outside].item()) + 20.0}
    options.append({"temperature": 0.0, "logit_bias": bias, "presence_penalty": 40.0})

    def run(batcher: str) -> dict[str, list[int]]:
        requests = [
            prepared(f"r{i}", prompts[i % len(prompts)], 14, **o) for i, o in enumerate(options)
        ]
        out = drive(chat.engine(batcher=batcher, max_running=4), requests)
        return {rid: token_ids(deltas) for rid, deltas in out.items()}

    rows, theirs = run("rows"), run("mlx_lm")
    assert rows == theirs
    penalized = rows[f"r{len(options) - 1}"]
    assert penalized[0] == outside and penalized.count(outside) == 1


def test_a_group_whose_rows_all_left_is_dropped_at_once(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = _batch(chat.model, prefill_step_size=2)
    [victim] = insert_greedy(batch, chat, [prompts[2]])
    batch.step()
    assert batch.groups and batch.active
    batch.remove([victim])
    assert batch.groups == [] and not batch.active  # its partial KV goes with it


def test_into_a_large_batch_rows_join_a_few_at_a_time(
    chat: Loaded, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of n rows takes joiners n // JOIN_DIVISOR at a time, or once the oldest has
    waited that many steps; an empty batch takes them at once. They decode as alone."""
    monkeypatch.setattr(rows_module, "JOIN_DIVISOR", 4)  # 8 running rows: groups of 2
    batch = _batch(chat.model)
    out: dict[int, list[int]] = {}
    first = insert_greedy(batch, chat, [prompts[i % len(prompts)] for i in range(8)])
    run_steps(batch, 1, out)  # nothing was running: all start at once
    assert len(batch.rows) == 8 and not batch.waiting
    [lone] = insert_greedy(batch, chat, [prompts[1]])
    run_steps(batch, 1, out)
    assert batch.waiting and lone not in {r.uid for r in batch.rows}  # waits for company
    run_steps(batch, 1, out)  # or for two steps, whichever comes first
    assert not batch.waiting and lone in {r.uid for r in batch.rows}
    pair = insert_greedy(batch, chat, [prompts[2], prompts[3]])
    run_steps(batch, 1, out)  # two of them: they start at once
    assert {r.uid for r in batch.rows} >= set(pair)
    run_steps(batch, 16, out)
    for uid, prompt in [(lone, prompts[1]), *zip(pair, prompts[2:4], strict=True)]:
        assert out[uid][:12] == reference_greedy(chat.model, prompt, 12), uid
    for uid, i in zip(first, range(8), strict=True):
        assert out[uid][:16] == reference_greedy(chat.model, prompts[i % len(prompts)], 16)


def test_with_settle_steps_a_group_waits_for_the_rest_of_a_wave(
    chat: Loaded, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `settle_steps`, joiners enough to start still wait while rows keep arriving,
    until a step passes without one, or until the oldest has waited as long as a small
    group would; they decode as alone."""
    monkeypatch.setattr(rows_module, "JOIN_DIVISOR", 2)  # 8 running rows: groups of 4
    batch = _batch(chat.model, settle_steps=1)
    out: dict[int, list[int]] = {}
    insert_greedy(batch, chat, [prompts[i % len(prompts)] for i in range(8)])
    run_steps(batch, 1, out)

    def running(uids: list[int]) -> bool:
        return set(uids) <= {r.uid for r in batch.rows}

    wave = insert_greedy(batch, chat, [prompts[i % len(prompts)] for i in range(4)])
    run_steps(batch, 1, out)  # enough to join, but they arrived in the last step
    assert not running(wave) and len(batch.waiting) == 4
    late = insert_greedy(batch, chat, [prompts[5]])
    run_steps(batch, 1, out)  # another arrived: still waiting
    assert not running(wave + late)
    run_steps(batch, 1, out)  # a step without arrivals: all five start together
    assert running(wave + late) and not batch.waiting
    # a steady trickle: the oldest starts once it has waited JOIN_DIVISOR's share of steps
    need = len(batch.rows) // 2  # 13 rows
    trickle: list[int] = []
    for i in range(2 * need):
        trickle += insert_greedy(batch, chat, [prompts[(i + 2) % len(prompts)]])
        run_steps(batch, 1, out)
        if running(trickle[:1]):
            break
    assert running(trickle) and len(trickle) == need
    run_steps(batch, 16, out)
    for uid, i in zip(wave, range(4), strict=True):
        assert out[uid][:12] == reference_greedy(chat.model, prompts[i % len(prompts)], 12)
    assert out[late[0]][:12] == reference_greedy(chat.model, prompts[5], 12)


class _MaskSpy:
    """The model, noting for each decode step whether its attention got a mask."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.masked: list[bool] = []

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        if inputs.shape[1] == 1:
            self.masked.append(cache[0].make_mask(1) is not None)
        return self.model(inputs, cache=cache)  # type: ignore[operator]


def test_a_step_masks_attention_only_while_a_row_is_padded(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    spy = _MaskSpy(chat.model)
    batch = _batch(spy)
    out: dict[int, list[int]] = {}
    n = min(len(p) for p in prompts if len(p) > 3)
    same = [p[:n] for p in prompts if len(p) > 3][:2]  # equal lengths: no padding
    first = insert_greedy(batch, chat, same)
    run_steps(batch, 4, out)
    assert not batch.padded and spy.masked == [False] * 4
    late = insert_greedy(batch, chat, [prompts[2]])  # starts later: the first rows are padded now
    run_steps(batch, 3, out)
    assert batch.padded and spy.masked[-1]
    batch.remove(late)  # compacted at the next step: the rows left started together
    run_steps(batch, 3, out)
    assert not batch.padded and spy.masked[-2:] == [False, False]
    for uid, prompt in zip(first, same, strict=True):
        assert out[uid] == reference_greedy(chat.model, prompt, len(out[uid])), uid
        assert len(out[uid]) >= 8
    assert out[late[0]] == reference_greedy(chat.model, prompts[2], len(out[late[0]]))
