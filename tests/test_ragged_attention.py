"""worker/backends/ragged_attention.py: what the kernel computes (each row's attention from
its first real position, as mlx-lm's mask has it), which layouts it takes, and that it is
made on MLX's CUDA backend only; on a CUDA machine, the kernel against that reference."""

from __future__ import annotations

import mlx.core as mx
import pytest

from worker.backends import ragged_attention


def _inputs(rows: int, heads: int, kv_heads: int, dim: int, length: int) -> tuple:
    keys = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((rows, heads, 1, dim), key=keys[0])
    # views of larger buffers, as a cache hands its keys and values over
    k = mx.random.normal((rows, kv_heads, length + 5, dim), key=keys[1])[..., :length, :]
    v = mx.random.normal((rows, kv_heads, length + 5, dim), key=keys[2])[..., :length, :]
    return q, k, v


def test_the_reference_attends_to_each_row_from_its_start() -> None:
    q, k, v = _inputs(3, 4, 2, 32, 9)
    starts = mx.array([0, 3, 8], dtype=mx.int32)
    got = ragged_attention.reference(q, k, v, starts, 0.25)
    for row, start in enumerate(starts.tolist()):
        alone = mx.fast.scaled_dot_product_attention(
            q[row : row + 1], k[row : row + 1, :, start:], v[row : row + 1, :, start:], scale=0.25
        )
        assert mx.allclose(got[row : row + 1], alone, atol=1e-5).item()
    # a row reading only its last position takes that position's values (its query heads
    # share the KV head of their group)
    assert mx.allclose(got[2, :2, 0], mx.repeat(v[2, :1, 8], 2, axis=0), atol=1e-5).item()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "takes"),
    [
        (32, 8, 64, True),  # Llama-3.2-1B
        (32, 8, 128, True),  # Llama-3.1-8B
        (16, 16, 128, True),  # no grouping
        (64, 4, 128, False),  # groups of 16: the warps' sums outgrow shared memory
        (12, 5, 64, False),  # query heads not whole groups
        (8, 2, 80, False),  # dimensions not a multiple of a warp's lanes
        (8, 2, 512, False),
    ],
)
def test_the_layouts_it_takes(heads: int, kv_heads: int, dim: int, takes: bool) -> None:
    assert ragged_attention.fits(heads, kv_heads, dim) is takes


@pytest.mark.skipif(mx.cuda.is_available(), reason="this machine has MLX's CUDA backend")
def test_no_kernel_without_cuda() -> None:
    assert ragged_attention.make(32, 8, 64, 0.125) is None


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on MLX's CUDA backend")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 64), (32, 8, 128), (8, 8, 96)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_the_kernel_computes_the_reference(
    heads: int, kv_heads: int, dim: int, dtype: mx.Dtype
) -> None:
    attend = ragged_attention.make(heads, kv_heads, dim, dim**-0.5)
    assert attend is not None
    for rows, length in ((1, 1), (5, 37), (33, 300)):
        q, k, v = (a.astype(dtype) for a in _inputs(rows, heads, kv_heads, dim, length))
        starts = mx.array([(7 * i) % length for i in range(rows)], dtype=mx.int32)
        got = attend(q, k, v, starts).astype(mx.float32)
        want = ragged_attention.reference(q, k, v, starts, dim**-0.5).astype(mx.float32)
        assert mx.allclose(got, want, rtol=2e-2, atol=2e-2).item()


class _StandIn:
    """What `make` builds on MLX's CUDA backend, computing the reference (or, `wrong`, a
    kernel that ignores the rows' starts) on this machine's device."""

    wrong = False

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, starts: mx.array) -> mx.array:
        if self.wrong:
            starts = mx.zeros_like(starts)
        return ragged_attention.reference(q, k, v, starts, self.scale)


@pytest.mark.parametrize("wrong", [False, True])
def test_a_kernel_is_used_only_once_it_computes_the_reference(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wrong: bool
) -> None:
    monkeypatch.setattr(ragged_attention.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ragged_attention.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(_StandIn, "wrong", wrong)
    monkeypatch.setattr(ragged_attention, "RaggedAttention", _StandIn)
    made = ragged_attention.make(8, 2, 32, 32**-0.5, mx.float32)
    assert (made is None) is wrong
    assert ("the kernel's output differs" in caplog.text) is wrong


@pytest.mark.skipif(mx.cuda.is_available(), reason="this machine builds the kernel")
def test_a_kernel_that_does_not_build_keeps_mlxs_attention(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ragged_attention.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ragged_attention.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert ragged_attention.make(8, 2, 32, 0.1) is None  # mx.fast.cuda_kernel: no CUDA here
    assert "the kernel failed" in caplog.text
    assert ragged_attention.make(8, 3, 32, 0.1) is None  # a layout it does not take
