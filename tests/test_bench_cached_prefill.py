"""benchmarks/cached_prefill.py on the tiny chat model: one line with the forward pass each
way and the attention at each new length, the cold lengths, and the cuDNN setting; each way
leaves the cached prefix as it found it."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from benchmarks import cached_prefill


@pytest.mark.usefixtures("no_mlx_settings")
def test_a_cached_turns_forward_and_attention(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--cached", "40", "--new", "3,9", "--trials", "2"]
    assert cached_prefill.main(argv) == 0
    (line,) = [json.loads(out) for out in capsys.readouterr().out.splitlines()]
    assert line["cached"] == 40 and line["layers"] > 0
    assert line["cudnn_sdpa"] == "0"  # MLX as a worker runs it
    assert sorted(line["forward"]) == ["batch", "buckets", "plain"]  # every way by default
    for way in line["forward"].values():
        assert sorted(way) == ["3", "9"]
        assert all(s["first_ms"] > 0 and s["warm_ms"] > 0 for s in way.values())
    assert sorted(line["attention_ms"]) == sorted(cached_prefill.MASKS)  # every mask
    for masked in line["attention_ms"].values():
        assert sorted(masked) == ["3", "9"] and all(ms > 0 for ms in masked.values())
    assert len(line["cold_ms"]) == cached_prefill.COLD and all(ms > 0 for ms in line["cold_ms"])


@pytest.mark.usefixtures("no_mlx_settings")
def test_with_a_kernel_its_forward_pass_and_attention_are_timed(
    chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the prefill's kernel is made (MLX's CUDA backend; here MLX's attention stands
    in for it), a "kernel" way and a "kernel" attention beside the others."""
    from worker.backends import groups, prefill_attention
    from worker.backends.prefill_layers import PrefillLayers

    steps: list[object] = []

    def made(model: object, asked: bool, step: object = None) -> PrefillLayers:
        steps.append(step)
        scale = model.model.layers[0].self_attn.scale  # type: ignore[attr-defined]
        return PrefillLayers(lambda *a: prefill_attention.reference(*a, scale), False)

    monkeypatch.setattr(groups, "prefill_kernel", made)
    argv = [str(chat_model), "--cached", "40", "--new", "9", "--trials", "1"]
    assert cached_prefill.main([*argv, "--via", "kernel,kernel-modules"]) == 0
    (line,) = [json.loads(out) for out in capsys.readouterr().out.splitlines()]
    assert sorted(line["forward"]) == ["kernel", "kernel-modules", "plain"]
    assert [s is not None for s in steps] == [True, False]  # the worker's way, the modules
    assert sorted(line["attention_ms"]) == sorted([*cached_prefill.MASKS, "kernel"])
    assert line["attention_ms"]["kernel"]["9"] > 0


def test_each_mask_is_the_causal_attention_a_cache_hands_over() -> None:
    """The mask arrays give the causal mask's attention; the bucket's keys past the written
    ones are hidden."""
    q = mx.random.normal((1, 4, 5, 8))
    keys = mx.random.normal((1, 2, 300, 8)), mx.random.normal((1, 2, 300, 8))
    width, causal = cached_prefill.keys_and_mask("causal", 20, 5)
    assert (width, causal) == (25, "causal")
    k, v = (x[:, :, :25] for x in keys)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal")
    for mask, width_wanted in (("array", 25), ("bucket", 256)):
        width, given = cached_prefill.keys_and_mask(mask, 20, 5)
        assert width == width_wanted and given.shape == (1, 1, 5, width)
        k, v = (x[:, :, :width] for x in keys)
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=given)
        assert mx.allclose(got, want, atol=1e-5).item(), mask


def _prefix(chat_model: Path, cached: int) -> tuple[object, list]:
    model, _ = load(str(chat_model))
    cache = make_prompt_cache(model)
    model(mx.array([[5 + i % 50 for i in range(cached)]]), cache=cache)
    mx.eval([c.state for c in cache])
    return model, cache


def test_every_way_leaves_the_cached_prefix_as_it_found_it(chat_model: Path) -> None:
    model, cache = _prefix(chat_model, 30)
    keys = np.array(cache[0].state[0][..., :30, :])  # a copy of its own
    cached_prefill.plain(model, cache, 7)
    for way in cached_prefill.WAYS:
        cached_prefill.batched(model, cache, 7, way)
    assert all(c.offset == 30 for c in cache)
    assert np.array_equal(np.array(cache[0].state[0][..., :30, :]), keys)


def test_a_batch_cache_the_buckets_cannot_read_is_an_error(
    chat_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, cache = _prefix(chat_model, 20)
    monkeypatch.setattr("worker.backends.prefill_buckets.views", lambda caches: None)
    with pytest.raises(RuntimeError, match="not bucketed"):
        cached_prefill.batched(model, cache, 4, "buckets")


def test_the_plain_forward_pass_alone(chat_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(chat_model), "--cached", "20", "--new", "4", "--trials", "1", "--via", ""]
    assert cached_prefill.main(argv) == 0
    (line,) = [json.loads(out) for out in capsys.readouterr().out.splitlines()]
    assert list(line["forward"]) == ["plain"]


@pytest.mark.parametrize("argv", [["--cached", "0"], ["--via", "batch,paged"], ["--new", "16,600"]])
def test_bad_arguments_are_refused_before_loading(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cached_prefill.main(["/nonexistent-model", *argv])
    assert exit_info.value.code == 2
