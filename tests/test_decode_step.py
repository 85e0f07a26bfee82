"""worker/backends/decode_step.py: the compiled one-token step gives mlx-lm's tokens on every
architecture it takes (plain, biased, quantized, with head norms), inside the rows batch with
and without padding; it refuses what it does not know, and a model that no longer computes
what it does fails its probe."""

from __future__ import annotations

import gc
import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache

from shared.config import EngineOptions
from tests.engine_fixtures import Loaded, reference_greedy
from worker.backends import decode_step, projections, ragged_attention
from worker.backends.mlx_lm import make_backend
from worker.backends.rows import RowBatch
from worker.backends.sampling import greedy

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [20]]


def _tiny(module: Any, **overrides: Any) -> Any:
    args: dict[str, Any] = {
        "model_type": module.__name__.rsplit(".", 1)[-1],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 97,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    if module is qwen3:
        args.update(head_dim=16, max_position_embeddings=512)
    args.update(overrides)
    mx.random.seed(7)
    model = module.Model(module.ModelArgs(**args))
    mx.eval(model.parameters())
    return model


def _decode(model: Any, step: Any, prompts: list[list[int]], late: int, steps: int) -> list:
    """Greedy tokens of each prompt in one rows batch; the last `late` prompts join after
    three steps (their rows are padded: the masked path)."""
    batch = RowBatch(model, decode=step)
    out: dict[int, list[int]] = {}

    def insert(group: list[list[int]]) -> list[int]:
        return batch.insert(
            group,
            [make_prompt_cache(model) for _ in group],
            [[] for _ in group],
            [greedy] * len(group),
            [[] for _ in group],
        )

    uids = insert(prompts[: len(prompts) - late])
    for n in range(steps):
        if n == 3 and late:
            uids += insert(prompts[len(prompts) - late :])
        for uid, token, _ in batch.step(logprobs=False):
            out.setdefault(uid, []).append(token)
    return [out[u] for u in uids]


ARCHITECTURES = [
    pytest.param(llama, {}, id="llama"),
    pytest.param(llama, {"attention_bias": True, "mlp_bias": True}, id="llama-bias"),
    pytest.param(llama, {"tie_word_embeddings": True}, id="llama-tied"),
    pytest.param(qwen2, {}, id="qwen2"),
    pytest.param(qwen3, {}, id="qwen3"),
]


@pytest.mark.parametrize(("module", "overrides"), ARCHITECTURES)
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "4bit"])
@pytest.mark.parametrize("fuse", [False, True], ids=["apart", "stacked"])
def test_the_same_greedy_tokens_as_the_models_forward_pass(
    module: Any, overrides: dict[str, Any], quantized: bool, fuse: bool
) -> None:
    model = _tiny(module, **overrides)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    step = decode_step.build(model, fuse=fuse)
    assert step is not None and step.shape.fused == fuse
    calls = {"masked": 0, "plain": 0}

    def counted(tokens: mx.array, caches: list[Any], masked: bool) -> mx.array:
        calls["masked" if masked else "plain"] += 1
        return step(tokens, caches, masked)

    # one row alone (no mask), rows that started together, rows joining later (padded)
    for prompts, late in (([PROMPTS[0]], 0), (PROMPTS[:3], 0), (PROMPTS, 2)):
        got = _decode(model, counted, prompts, late, 14)
        assert got == _decode(model, None, prompts, late, 14)
    assert calls["masked"] > 5 and calls["plain"] > 5  # both paths were the step's


@pytest.mark.parametrize(("module", "overrides"), [ARCHITECTURES[0], ARCHITECTURES[4]])
def test_padded_rows_attend_through_the_ragged_kernel_where_there_is_one(
    module: Any, overrides: dict[str, Any]
) -> None:
    """The kernel runs on MLX's CUDA backend only (test_ragged_attention.py checks it there);
    here a stand-in computing what it computes shows that the step hands it each row's
    first real position and the cache's keys, and that the tokens stay the model's."""
    model = _tiny(module, **overrides)
    step = decode_step.build(model)
    assert step is not None and step.ragged is None  # no CUDA here
    starts_seen: list[list[int]] = []

    def stand_in(q: mx.array, k: mx.array, v: mx.array, starts: mx.array) -> mx.array:
        starts_seen.append(starts.tolist())
        return ragged_attention.reference(q, k, v, starts, step.scale)

    step.ragged = stand_in
    assert _decode(model, step, PROMPTS, 2, 14) == _decode(model, None, PROMPTS, 2, 14)
    assert len(starts_seen) > 5 and all(len(set(s)) > 1 for s in starts_seen)  # padded rows


@pytest.mark.parametrize(("module", "overrides"), ARCHITECTURES)
def test_the_same_logits_in_half_precision(module: Any, overrides: dict[str, Any]) -> None:
    """bfloat16 rounds every step the model's way (a bias added as nn.Linear adds it):
    the logits are the same bits, not only the same argmax."""
    model = _tiny(module, **overrides)
    model.set_dtype(mx.bfloat16)
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("bias"):  # biases that matter (the tiny model's start at 0)
            model.update(
                tree_unflatten([(name, mx.random.normal(value.shape).astype(value.dtype))])
            )
    step = decode_step.build(model)
    assert step is not None
    mine, theirs = make_prompt_cache(model), make_prompt_cache(model)
    prompt = mx.array([PROMPTS[2]])
    model(prompt, cache=mine)
    model(prompt, cache=theirs)
    token = mx.array([4])
    for _ in range(6):
        want = model(token[:, None], cache=theirs)[:, -1, :]
        got = step(token, mine, masked=False)
        assert mx.array_equal(got, want).item()
        token = mx.argmax(want, axis=-1)


def test_a_row_decodes_as_mlx_lms_generate_step(chat: Loaded, prompts: list[list[int]]) -> None:
    step = decode_step.build(chat.model)
    assert step is not None
    got = _decode(chat.model, step, prompts[:4], 2, 24)
    for tokens, prompt in zip(got, prompts[:4], strict=True):
        assert tokens[:16] == reference_greedy(chat.model, prompt, 16)


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "4bit"])
def test_stacked_projections_are_not_a_second_copy_of_the_weights(quantized: bool) -> None:
    """The model's own layers read slices of the stacked matrices: memory does not grow by
    the projections' bytes, and the model's forward pass computes the same bits."""
    model = _tiny(llama, hidden_size=128, intermediate_size=512)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    prompt = mx.array([PROMPTS[2]])
    before = model(prompt)
    mx.eval(before)
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory()
    stacked = sum(
        v.nbytes
        for name, v in tree_flatten(model.parameters())
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    )
    step = decode_step.build(model, fuse=True)
    assert step is not None and step.shape.fused
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() - active < stacked / 10
    assert mx.array_equal(model(prompt), before).item()


def test_projections_are_stacked_after_a_probe_of_them_apart_and_checked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On CUDA the stacked multiplications round otherwise than three separate ones, past the
    probe's tolerance over a model's layers: the probe checks the step's structure apart, and
    the stacked multiplications are then checked against the separate ones. Stacked in the
    wrong order (a stand-in), the projections stay apart and the tokens the model's."""
    probed: list[bool] = []
    probe = decode_step.probe

    def recorded(model: Any, step: decode_step.DecodeStep) -> bool:
        probed.append(step.shape.fused)
        return probe(model, step)

    monkeypatch.setattr(decode_step, "probe", recorded)
    model = _tiny(llama)
    step = decode_step.build(model, fuse=True)
    assert step is not None and step.shape.fused and probed == [False]
    assert _decode(model, step, PROMPTS, 2, 10) == _decode(model, None, PROMPTS, 2, 10)

    fuse_into = decode_step.fuse_into

    def misordered(modules: list[Any], found: list[Any]) -> Any:
        kind, arrays = fuse_into(modules, found)  # the model's own views stay right
        return kind, [a[::-1] for a in arrays]  # the step's rows reversed

    monkeypatch.setattr(decode_step, "fuse_into", misordered)
    model = _tiny(llama)
    with caplog.at_level(logging.WARNING, logger=decode_step.__name__):
        step = decode_step.build(model, fuse=True)
    assert step is not None and not step.shape.fused
    assert "projections kept apart (stacked, they multiply otherwise" in caplog.text
    assert _decode(model, step, PROMPTS, 2, 10) == _decode(model, None, PROMPTS, 2, 10)


def test_stacking_that_fails_keeps_the_projections_apart_and_the_weights_right(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory halfway through the layers, or views that would not read the model's
    own bits: the step keeps its projections apart, and the model computes what it did."""
    fuse_into, calls = decode_step.fuse_into, []

    def failing(modules: list[Any], found: list[Any]) -> Any:
        calls.append(1)
        if len(calls) == 3:  # the second layer's Q/K/V
            raise MemoryError("no room for the stacked copy")
        return fuse_into(modules, found)

    monkeypatch.setattr(decode_step, "fuse_into", failing)
    model = _tiny(llama)
    before = model(mx.array([PROMPTS[2]]))
    with caplog.at_level(logging.WARNING, logger=decode_step.__name__):
        step = decode_step.build(model, fuse=True)
    assert step is not None and not step.shape.fused
    assert "projections kept apart (stacking failed: no room" in caplog.text
    assert mx.array_equal(model(mx.array([PROMPTS[2]])), before).item()
    assert _decode(model, step, PROMPTS, 2, 10) == _decode(model, None, PROMPTS, 2, 10)

    monkeypatch.setattr(decode_step, "fuse_into", fuse_into)
    concatenate = mx.concatenate
    # stacked in another order than the modules': each module's slice is another's rows
    monkeypatch.setattr(
        projections.mx, "concatenate", lambda arrays, axis: concatenate(arrays[::-1], axis=axis)
    )
    model = _tiny(llama)
    weights = dict(tree_flatten(model.parameters()))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=decode_step.__name__):
        step = decode_step.build(model, fuse=True)
    assert step is not None and not step.shape.fused
    assert "did not stack" in caplog.text
    assert all(v is weights[n] for n, v in tree_flatten(model.parameters()))  # untouched


def test_models_it_does_not_know_keep_their_forward_pass(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=decode_step.__name__)
    sliding = _tiny(
        llama,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=4,
    )
    assert decode_step.build(sliding) is None
    other = _tiny(llama)
    other.model_type = "gemma"  # our own test model: what build reads to pick architectures
    assert decode_step.build(other) is None
    lora = _tiny(llama)
    # a layer of another kind (here a LoRA-like wrapper) is one the step cannot multiply
    lora.model.layers[1].mlp.up_proj = _Wrapped(lora.model.layers[1].mlp.up_proj)
    assert decode_step.build(lora) is None
    piped = _tiny(qwen2)  # a pipeline rank's model: the layers of other ranks are None
    piped.model.layers = [None, *piped.model.layers[1:]]
    assert decode_step.build(piped) is None
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 4
    assert "a pipeline shard" in reasons[3]
    assert "sliding-window layers" in reasons[0]
    assert "model type 'gemma'" in reasons[1]
    assert "a decoder layer of a kind the step does not know" in reasons[2]
    # under engine.decode_step = "auto" a model it does not know is news, not a warning
    caplog.clear()
    assert decode_step.build(other, asked=False) is None
    assert [r.levelno for r in caplog.records] == []
    caplog.set_level(logging.INFO, logger=decode_step.__name__)
    assert decode_step.build(other, asked=False) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_a_probe_that_fails_leaves_the_forward_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A probe that raises (a kernel library another user's process half-wrote, say) is
    tried again, then the model keeps mlx-lm's forward pass: its load does not fail."""
    calls: list[int] = []

    def broken(model: Any, step: Any) -> bool:
        calls.append(1)
        raise RuntimeError("kernel library unreadable")

    monkeypatch.setattr(decode_step, "probe", broken)
    monkeypatch.setattr(decode_step.time, "sleep", lambda s: None)
    caplog.set_level(logging.WARNING, logger=decode_step.__name__)
    assert decode_step.build(_tiny(llama)) is None
    assert len(calls) == decode_step.PROBE_ATTEMPTS
    assert "could not be built" in caplog.records[-1].getMessage()


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x)


def test_a_model_that_computes_something_else_fails_the_probe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _tiny(llama)
    # the step takes the first layer's RoPE for every layer: a model whose later layers
    # rotate differently is one whose forward pass the step would not reproduce
    model.model.layers[2].self_attn.rope = nn.RoPE(16, base=500.0)
    model.model.layers[0].self_attn.rope = nn.RoPE(16, base=10000.0)
    assert decode_step.build(model) is None
    assert "differ from the model's on a probe" in caplog.text


def test_the_engine_setting_picks_the_step(chat: Loaded) -> None:
    compiled = make_backend(
        chat.model, chat.tokenizer, EngineOptions(batcher="rows", decode_step="compiled")
    )
    assert compiled.batch.decode is not None  # type: ignore[attr-defined]
    plain = make_backend(
        chat.model, chat.tokenizer, EngineOptions(batcher="rows", decode_step="model")
    )
    assert plain.batch.decode is None  # type: ignore[attr-defined]
    # the default: compiled where measured faster, MLX's CPU among them (these tests' device)
    auto = make_backend(chat.model, chat.tokenizer, EngineOptions(batcher="rows"))
    assert auto.batch.decode is not None  # type: ignore[attr-defined]
    assert auto.batch.decode.ragged is None  # type: ignore[attr-defined]
    assert not auto.batch.decode.shape.fused  # type: ignore[attr-defined]
    options = EngineOptions(batcher="rows", decode_projections="stacked")
    stacked = make_backend(chat.model, chat.tokenizer, options)
    assert stacked.batch.decode.shape.fused  # type: ignore[attr-defined]


def test_the_ragged_kernel_asked_for_where_it_cannot_run_is_a_warning(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    options = EngineOptions(batcher="rows", decode_step="compiled", decode_attention="kernel")
    with caplog.at_level(logging.WARNING):
        backend = make_backend(chat.model, chat.tokenizer, options)
    assert backend.batch.decode.ragged is None  # type: ignore[attr-defined]  # MLX's CPU
    assert "decode_attention = 'kernel': MLX's attention with a mask" in caplog.text


def test_step_settings_where_auto_keeps_the_forward_pass_are_a_warning(
    chat: Loaded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_step, "wanted", lambda setting: setting == "compiled")  # Metal
    options = EngineOptions(batcher="rows", decode_projections="stacked", decode_attention="kernel")
    with caplog.at_level(logging.WARNING):
        backend = make_backend(chat.model, chat.tokenizer, options)
    assert backend.batch.decode is None  # type: ignore[attr-defined]
    assert (
        "engine.decode_projections = 'stacked', decode_attention = 'kernel': no effect here"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make_backend(chat.model, chat.tokenizer, EngineOptions(batcher="rows"))
    assert "no effect here" not in caplog.text


def test_auto_compiles_on_cpu_and_cuda_and_not_on_metal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert decode_step.wanted("compiled") and not decode_step.wanted("model")
    assert decode_step.wanted("auto")  # MLX's CPU here
    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(decode_step.mx, "default_device", lambda: gpu)
    monkeypatch.setattr(decode_step.mx.cuda, "is_available", lambda: True)
    assert decode_step.wanted("auto")
    monkeypatch.setattr(decode_step.mx.cuda, "is_available", lambda: False)  # Metal
    assert not decode_step.wanted("auto") and decode_step.wanted("compiled")
