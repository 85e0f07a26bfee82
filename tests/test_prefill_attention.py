"""worker/backends/prefill_attention.py off CUDA: what the kernel computes (its reference, by
hand), the layouts it takes, its load-time check, and, where NVIDIA's compiler is installed,
that its source compiles for the tensor cores it is written for. Its output on a GPU is
checked at every load (`make`) and by benchmarks/h200.sh."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from worker.backends import prefill_attention
from worker.backends.prefill_attention import CASES, disagreement, fits, make, reference


def by_hand(q: Any, k: Any, v: Any, base: int, starts: list[int], scale: float) -> Any:
    """Query i of row b over keys starts[b] <= j <= base + i, head h over KV head h // R."""
    rows, heads, n, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros((rows, n, heads, dim), np.float64)
    for b in range(rows):
        for h in range(heads):
            for i in range(n):
                keys = slice(starts[b], base + i + 1)
                s = k[b, h // group, keys] @ q[b, h, i] * scale
                p = np.exp(s - s.max())
                out[b, i, h] = p @ v[b, h // group, keys] / p.sum()
    return out


def test_the_reference_is_the_attention_over_each_querys_visible_keys() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 3, 8), (2, 2, 12, 8), (2, 2, 12, 8)))
    got = reference(mx.array(q), mx.array(k), mx.array(v), 6, mx.array([0, 4]), 0.3)
    want = by_hand(q, k, v, 6, [0, 4], 0.3)
    assert np.allclose(np.array(got), want, atol=1e-5)  # keys 9-11: past every query


def test_the_layouts_it_takes() -> None:
    assert fits(32, 8, 64, mx.bfloat16) and fits(32, 8, 128, mx.float16)
    assert not fits(32, 8, 64, mx.float32)  # the tensor cores' inputs here: 16-bit
    assert not fits(30, 8, 64, mx.bfloat16)  # a partial query group
    assert not fits(32, 8, 256, mx.bfloat16)  # shared memory: up to 128
    assert not fits(32, 8, 80, mx.bfloat16)  # not a multiple of 32 (a block's loads)
    assert not fits(32, 0, 64, mx.bfloat16)


def test_keys_are_split_only_where_blocks_are_few() -> None:
    """As measured on an H100: 64 and 128 queries of 32 heads on 4,400 cached keys (32 and
    64 blocks) split 17 and 9 ways; 256 queries (128 blocks) and more not at all; never
    under SHARE keys a block."""
    assert prefill_attention.splits(32, 4608) == 17
    assert prefill_attention.splits(64, 4608) == 9
    assert prefill_attention.splits(128, 4864) == 1 and prefill_attention.splits(256, 8704) == 1
    assert prefill_attention.splits(32, 600) == 2 and prefill_attention.splits(8, 300) == 1


class Standin:
    """An `attend` with the kernel's interface that computes `reference`, give or take."""

    def __init__(self, scale: float, wrong: float = 0.0, late: int = 0) -> None:
        self.heads, self.kv_heads, self.head_dim = 8, 2, 32
        self.scale, self.wrong, self.late = scale, wrong, late

    def __call__(self, q: Any, k: Any, v: Any, base: mx.array, starts: mx.array) -> mx.array:
        out = reference(q, k, v, base + self.late, starts, self.scale)
        return out + self.wrong


def test_the_check_passes_the_reference_and_names_where_another_differs() -> None:
    assert disagreement(Standin(0.2), 0.2, mx.bfloat16) is None  # type: ignore[arg-type]
    off = disagreement(Standin(0.2, wrong=0.1), 0.2, mx.bfloat16)  # type: ignore[arg-type]
    assert off is not None and off.startswith("1 rows of 5 queries over 5 keys: off by up to")
    # a causal limit one key late: a query sees the key after its own
    off = disagreement(Standin(0.2, late=1), 0.2, mx.bfloat16)  # type: ignore[arg-type]
    assert off is not None and "off by up to" in off
    # every case hands keys past its queries (a bucket's unwritten positions) or left padding
    assert all(width > base + n or max(starts) > 0 for _, n, base, width, starts, _ in CASES[1:])


def test_make_keeps_mlxs_attention_off_cuda_and_says_why_on_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert make(32, 8, 64, 0.125, mx.bfloat16) is None
    monkeypatch.setattr(prefill_attention, "on_cuda", lambda: True)
    caplog.set_level("INFO")
    assert make(32, 8, 256, 0.125, mx.bfloat16) is None
    assert "prefill attention: MLX's (32 heads, 8 KV heads of 256, mlx.core.bfloat16)" in (
        caplog.text
    )

    assert make(32, 8, 64, 0.125, mx.bfloat16) is None  # MLX's CPU: no CUDA kernel to make
    assert "prefill attention: MLX's (the kernel failed: " in caplog.text
    made = Standin(0.125, wrong=0.1)
    monkeypatch.setattr(prefill_attention, "PrefillAttention", lambda *a: made)
    assert make(8, 2, 32, 0.125, mx.bfloat16) is None
    assert "the kernel's output differs: 1 rows of 5 queries over 5 keys: off by up" in caplog.text
    made.wrong = 0.0
    assert make(8, 2, 32, 0.125, mx.bfloat16) is made


def parameters(kind: str, inputs: tuple[str, ...], extra: str, outputs: str) -> str:
    """A kernel's parameters as MLX declares them: each input, its shape and strides."""
    params = [
        f"const {kind}* {a}, const int32_t* {a}_shape, const int64_t* {a}_strides" for a in inputs
    ]
    return ", ".join([*params, *([extra] if extra else []), outputs])


ATTENTION = "const int32_t* starts, const int32_t* base, const float* scale"
KERNELS = (  # name, template, its inputs' type and names, their other inputs, outputs
    ("attend", "T D R THREADS", "T", ("q", "k", "v"), ATTENTION, "T* out"),
    ("split", "T D R THREADS", "T", ("q", "k", "v"), ATTENTION, "float* parts, float* sums"),
    ("combine", "T D", "float", ("parts", "sums"), "", "T* out"),
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="NVIDIA's compiler is not installed")
def test_the_kernels_compile_for_the_tensor_cores_without_spilling(tmp_path: Path) -> None:
    """The sources as MLX compiles them (each body in a function of the inputs, their shapes
    and strides; T, D, R and THREADS its template), for sm_90 (Hopper, where it was
    measured), at the head sizes of the models it was measured on and the least it takes,
    without registers spilled to memory."""
    header = prefill_attention.HEADER
    lines = ["#include <cstdint>", "#include <cuda_bf16.h>", "#include <cuda_fp16.h>"]
    lines += ["#include <cuda/std/limits>", header]
    sources = {
        "attend": prefill_attention.SOURCE,
        "split": prefill_attention.SPLIT_SOURCE,
        "combine": prefill_attention.COMBINE_SOURCE,
    }
    count = 0
    for name, template, kind, inputs, extra, outputs in KERNELS:
        params = parameters(kind, inputs, extra, outputs)
        names = ", ".join(("typename " if t == "T" else "int ") + t for t in template.split())
        lines += [f"template <{names}>", f"__global__ void {name}({params}) {{", sources[name], "}"]
        for dtype in ("__nv_bfloat16", "__half"):
            for dim, group in ((64, 4), (128, 4), (32, 8)):
                values = {"T": dtype, "D": str(dim), "R": str(group), "THREADS": "128"}
                chosen = ", ".join(values[t] for t in template.split())
                if f"{name}<{chosen}>" in lines[-1]:
                    continue  # combine: the group is no template argument
                types = re.sub(r"\bT\*", f"{dtype}*", params)
                lines.append(f"template __global__ void {name}<{chosen}>({types});")
                count += 1
    path = tmp_path / "prefill_attention.cu"
    path.write_text("\n".join(lines))
    for arch in ("sm_90",):
        done = subprocess.run(
            ["nvcc", f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", str(path)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
        assert len(spills) == count and set(spills) == {"0"}, done.stderr[-3000:]
