"""worker/backends/prefill_layers.py and its place in groups.py: a prefill's layers computed by
the project (the model's modules, attention by a kernel), on real tiny models. Off CUDA the
kernel does not exist; here MLX's own attention stands in for it (prefill_attention's
`reference`, the function the kernel is checked against), so that what is tested is
everything around the kernel: the layers, the positions and padding it is handed, the
caches written, the tokens."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from shared.engine_options import EngineOptions
from tests.engine_fixtures import Loaded, insert_greedy, load, reference_greedy, run_steps
from worker.backends import decode_step, groups, prefill_attention
from worker.backends.groups import FirstToken, first_token
from worker.backends.mlx_lm import make_backend
from worker.backends.prefill_layers import PrefillLayers, takes
from worker.backends.rows import RowBatch
from worker.backends.sampling import greedy


def mlx_attention(model: Any) -> Any:
    scale = model.model.layers[0].self_attn.scale

    def attend(q: mx.array, k: mx.array, v: mx.array, base: mx.array, starts: mx.array) -> Any:
        return prefill_attention.reference(q, k, v, base, starts, scale)

    return attend


def with_layers(model: Any, step: Any = None) -> FirstToken:
    head_norms = hasattr(model.model.layers[0].self_attn, "q_norm")
    return FirstToken(model, PrefillLayers(mlx_attention(model), head_norms, step))


@pytest.fixture(scope="module")
def qwen3_model() -> Any:
    """Qwen3's layers: per-head norms of queries and keys before RoPE."""
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        head_dim=16,
        tie_word_embeddings=True,
    )
    mx.random.seed(3)
    model = qwen3.Model(args)
    for layer in model.model.layers:  # norms not all ones: a norm's weight swapped shows
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm):
            norm.weight = 1 + 0.5 * mx.random.normal(norm.weight.shape)
    mx.eval(model.parameters())
    return model


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model(request: pytest.FixtureRequest, chat: Loaded, qwen2_model: Any) -> Any:
    if request.param == "llama":
        return chat.model
    if request.param == "qwen2":
        return load(qwen2_model).model
    return request.getfixturevalue("qwen3_model")


def test_the_layers_give_the_models_first_tokens(model: Any) -> None:
    """The probe of groups.py: one row, and two rows of different lengths side by side."""
    assert groups.probe(model, with_layers(model)) is None


@pytest.mark.parametrize("fuse", [False, True], ids=["apart", "stacked"])
def test_the_compiled_layers_give_the_models_first_tokens(model: Any, fuse: bool) -> None:
    """With the compiled decode step, each layer is its two compiled functions around the
    attention, over a chunk's positions: the same probe passes, and those functions ran."""
    step = decode_step.build(model, fuse=fuse)
    assert step is not None
    ran: list[int] = []
    project = step.project

    def counted(i: int, x: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        ran.append(x.shape[1])
        return project(i, x, offset)

    step.project = counted  # type: ignore[method-assign]
    assert groups.probe(model, with_layers(model, step)) is None
    assert len(ran) >= len(model.model.layers) and max(ran) > 1


def test_compiled_layers_that_compute_another_layer_fail_the_probe(chat: Loaded) -> None:
    """The probe checks the compiled functions too: a layer's output off by its input
    (a residual counted twice) is found."""
    step = decode_step.build(chat.model)
    assert step is not None
    close = step.close

    def doubled(i: int, x: mx.array, out: mx.array) -> mx.array:
        return close(i, x, out) + x

    step.close = doubled  # type: ignore[method-assign]
    assert groups.probe(chat.model, with_layers(chat.model, step)) is not None


@pytest.mark.parametrize("compiled", [False, True], ids=["modules", "compiled"])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_chunks_before_the_last_and_the_last_give_mlx_lms_tokens(
    chat: Loaded, prompts: list[list[int]], buckets: bool, compiled: bool
) -> None:
    """Rows of several chunks, of different lengths: every chunk's keys and values come from
    the project's layers (the model's modules, or the compiled decode step's functions),
    and the tokens are mlx-lm's."""
    calls: list[int] = []
    attend = mlx_attention(chat.model)
    step = decode_step.build(chat.model) if compiled else None

    def counted(q: mx.array, k: mx.array, v: mx.array, base: mx.array, starts: mx.array) -> Any:
        calls.append(q.shape[2])
        return attend(q, k, v, base, starts)

    first = FirstToken(chat.model, PrefillLayers(counted, False, step))
    batch = RowBatch(chat.model, prefill_step_size=8, prefill_buckets=buckets, first=first)
    chosen = sorted(prompts, key=len)[-4:]
    assert len({len(p) for p in chosen}) > 1 and min(len(p) for p in chosen) > 8
    uids = insert_greedy(batch, chat, chosen)
    tokens: dict[int, list[int]] = {}
    run_steps(batch, 40, tokens)
    # every chunk's every layer through the project's layers, chunks before the last too:
    # rows of as many chunks prefill together, so a group a count, each chunk every layer
    layers = len(chat.model.model.layers)
    chunks = {-(-len(p) // 8) for p in chosen}
    assert len(calls) >= layers * sum(chunks), (len(calls), layers, chunks)
    for uid, prompt in zip(uids, chosen, strict=True):
        assert tokens[uid][:5] == reference_greedy(chat.model, prompt, 5), len(prompt)


@pytest.mark.parametrize("compiled", [False, True], ids=["modules", "compiled"])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_rows_over_cached_prefixes_of_different_lengths(
    chat: Loaded, prompts: list[list[int]], buckets: bool, compiled: bool
) -> None:
    """Two rows whose prefixes were cached (prefix cache hits of 17 and 5 positions),
    prefilled together: the shorter prefix is padded on the left in the group's cache, and
    the attention is handed where each row's keys start."""
    long = max(prompts, key=len)
    full = [[*long, 9, 8, 7], [(t + 3) % 400 + 5 for t in long][:20]]
    cut = [17, 5]
    caches = []
    for prompt, n in zip(full, cut, strict=True):
        cache = make_prompt_cache(chat.model)
        chat.model(mx.array(prompt[:n])[None], cache=cache)
        caches.append(cache)
    seen: list[list[int]] = []
    attend = mlx_attention(chat.model)

    def recorded(q: mx.array, k: mx.array, v: mx.array, base: mx.array, starts: mx.array) -> Any:
        seen.append(starts.tolist())
        return attend(q, k, v, base, starts)

    step = decode_step.build(chat.model) if compiled else None
    first = FirstToken(chat.model, PrefillLayers(recorded, False, step))
    batch = RowBatch(chat.model, prefill_buckets=buckets, first=first)
    uids = batch.insert(
        [p[n:] for p, n in zip(full, cut, strict=True)],
        caches,
        [p[:n] for p, n in zip(full, cut, strict=True)],
        [greedy] * 2,
        [[], []],
    )
    tokens: dict[int, list[int]] = {}
    run_steps(batch, 8, tokens)
    assert seen[0] == [0, 12]  # the 5-position prefix sits after 12 positions of padding
    for uid, prompt in zip(uids, full, strict=True):
        assert tokens[uid][:5] == reference_greedy(chat.model, prompt, 5)


def test_a_cache_it_cannot_read_keeps_the_models_layers(chat: Loaded) -> None:
    """Plain KV caches (no batch state) go through the model's own forward pass."""
    assert not takes(make_prompt_cache(chat.model)) and not takes([])
    first = with_layers(chat.model)
    cache = make_prompt_cache(chat.model)
    first.forward(chat.model, mx.array([[1, 2, 3]]), cache)
    assert cache[0].offset == 3


def test_off_cuda_auto_and_mlx_keep_mlxs_attention_and_kernel_says_why(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    for setting in ("auto", "mlx"):
        found = first_token(chat.model, setting)
        assert found is not None and found.prefill is None
    assert "prefill attention" not in caplog.text
    caplog.set_level("INFO")
    found = first_token(chat.model, "kernel")
    assert found is not None and found.prefill is None
    assert "prefill attention: MLX's (the kernel runs on MLX's CUDA backend only)" in caplog.text
    assert "engine.prefill_attention = 'kernel': MLX's attention (logged above)" in caplog.text


def test_kernel_where_first_tokens_come_from_a_step_is_a_warning(
    chat: Loaded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """first_token = "auto" on a backend where it keeps mlx-lm's way (Metal): no prefill of
    the project's, so the kernel asked for has no effect, said so at load."""
    monkeypatch.setattr(groups, "wanted", lambda setting: setting == "prefill")  # Metal
    options = EngineOptions(batcher="rows", prefill_attention="kernel")
    with caplog.at_level(logging.WARNING):
        backend = make_backend(chat.model, chat.tokenizer, options)
    assert backend.batch.first is None  # type: ignore[attr-defined]
    assert "engine.prefill_attention = 'kernel': no effect here" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make_backend(chat.model, chat.tokenizer, EngineOptions(batcher="rows"))
    assert "no effect here" not in caplog.text


def test_a_kernel_made_is_used_where_the_layers_match_the_model(
    chat: Loaded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a kernel (MLX's attention standing in for one), auto on CUDA takes it; where
    the project's layers compute other logits than the model (here: the attention they are
    checked with made wrong), the model's own layers are kept, logged."""
    kernel = mlx_attention(chat.model)
    monkeypatch.setattr(groups, "on_cuda", lambda: True)
    monkeypatch.setattr(prefill_attention, "make", lambda *a: kernel)
    attn = chat.model.model.layers[0].self_attn
    dim = attn.q_proj.weight.shape[0] // attn.n_heads
    monkeypatch.setattr(prefill_attention, "AUTO_HEAD_DIMS", (dim,))  # a size measured
    found = first_token(chat.model, "auto")
    assert found is not None and found.prefill is not None
    assert found.prefill.attend is kernel
    reference = prefill_attention.reference
    monkeypatch.setattr(prefill_attention, "reference", lambda *a: 1.5 * reference(*a))
    found = first_token(chat.model, "kernel")
    assert found is not None and found.prefill is None
    assert "prefill attention: MLX's (the layers compute other logits: row 1" in caplog.text


def test_a_worker_runs_the_kernels_layers_on_its_compiled_decode_step(
    chat: Loaded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend hands its compiled decode step to the prefill's layers; layers on a step
    that fails the probe give way to the model's modules, the kernel kept."""
    caplog.set_level("INFO")
    monkeypatch.setattr(groups, "on_cuda", lambda: True)
    monkeypatch.setattr(prefill_attention, "make", lambda *a: mlx_attention(chat.model))
    attn = chat.model.model.layers[0].self_attn
    monkeypatch.setattr(
        prefill_attention, "AUTO_HEAD_DIMS", (attn.q_proj.weight.shape[0] // attn.n_heads,)
    )
    options = EngineOptions(batcher="rows", decode_step="compiled", first_token="prefill")
    batch = make_backend(chat.model, chat.tokenizer, options).batch  # type: ignore[attr-defined]
    assert batch.decode is not None and batch.first is not None
    assert batch.first.prefill is not None and batch.first.prefill.step is batch.decode
    step = decode_step.build(chat.model)
    assert step is not None
    close = step.close
    step.close = lambda i, x, out: close(i, x, out) + x  # type: ignore[method-assign]
    found = first_token(chat.model, "auto", step)
    assert found is not None and found.prefill is not None and found.prefill.step is None
    assert "its layers around the compiled step differ" in caplog.text


def test_auto_takes_the_kernel_only_for_heads_it_was_measured_faster_at(
    chat: Loaded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level("INFO")
    monkeypatch.setattr(groups, "on_cuda", lambda: True)
    monkeypatch.setattr(prefill_attention, "make", lambda *a: mlx_attention(chat.model))
    attn = chat.model.model.layers[0].self_attn
    dim = attn.q_proj.weight.shape[0] // attn.n_heads
    monkeypatch.setattr(prefill_attention, "AUTO_HEAD_DIMS", (dim,))
    found = first_token(chat.model, "auto")  # measured at the model's size: taken
    assert found is not None and found.prefill is not None
    monkeypatch.setattr(prefill_attention, "AUTO_HEAD_DIMS", (64, 128))
    assert dim not in (64, 128)
    found = first_token(chat.model, "auto")
    assert found is not None and found.prefill is None
    assert f"prefill attention: MLX's (heads of {dim}: the kernel was measured" in caplog.text
    found = first_token(chat.model, "kernel")  # asked for: taken
    assert found is not None and found.prefill is not None
