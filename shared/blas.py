"""Optimized BLAS for MLX's CPU backend on Linux.

mlx[cpu] wheels for Linux bundle the reference BLAS; preloading an optimized one (Debian's
libopenblas0-pthread) makes batched matmuls an order of magnitude faster. The preload must be
in the environment before the worker process starts, so the supervisor decides it at spawn,
for the device it detected (gateway/workers/device.py): `auto` preloads into CPU workers only, since
a GPU worker's matmuls never reach BLAS; an explicit library path is preloaded everywhere.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from shared.paths import cache_dir

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


class BlasError(ValueError):
    pass


def resolve_blas(
    setting: str, candidates: tuple[str, ...] | None = None, *, device: str = "cpu"
) -> str | None:
    """The library to preload for `setting` (auto | off | a path) into workers on `device`
    ("cpu" or "gpu"), or None. `auto` looks through `candidates` (default: CANDIDATES)."""
    if not sys.platform.startswith("linux") or setting == "off":
        return None
    if setting == "auto":
        if device != "cpu":
            return None
        found = CANDIDATES if candidates is None else candidates
        return next((c for c in found if Path(c).is_file()), None)
    if not Path(setting).is_file():
        raise BlasError(f"blas library not found: {setting}")
    return setting


def blas_thread_count(threads: int, cpus: int | None = None) -> int:
    """0 = auto: half the cores. MLX's own compute thread, the engine loop and the gateway
    need the rest; on 2 cores a second BLAS thread costs more in contention than it gains."""
    if threads > 0:
        return threads
    return max(1, (cpus or os.cpu_count() or 2) // 2)


# MLX's CUDA backend runs a prefill's attention through cuDNN, and builds cuDNN a graph for
# each new shape (rows, prompt length, cached length): 60-80 ms on an H200 each time, where
# the pass itself takes 8-15 ms for 128-token prompts. A server meets new shapes at almost
# every request (prompt lengths vary; a cached prefix changes the key length). Without it
# (MLX's own kernels) agent turns over a 4k-token prompt got their first token in 34-58 ms
# against 74-81 (one session; 123-177 against 224-251 with four), a whole 4-5k prefill in
# 160-230 ms against 230-890 (docs/lab/2026-12-gpu-runs.md). Other backends do not read it.
CUDNN_SDPA = "MLX_CUDA_USE_CUDNN_SDPA"

# MLX's CUDA backend keeps bounded LRU caches (instantiated CUDA graphs 400, cuDNN attention
# graphs 256, convolution plans 128, FFT plans 128) and, by default, raises "Cache thrashing is
# happening" once one of them has missed more than twice its capacity over the process's
# life: the count is never reset, whatever the share of hits (mlx/backend/cuda/lru_cache.h).
# A server meets new shapes for as long as it runs (prompt, audio and batch lengths, the
# compositions of its batches), so with the check on, a CUDA worker would fail after some
# hundreds of new shapes, every request it held with it. Off, the caches stay bounded (least
# recently used out) and nothing is raised. Other backends do not read it.
CACHE_THRASHING_CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"

# MLX's CUDA backend compiles some kernels with NVRTC at their first use in a process (the
# gathers a batch's joins and compactions run: 4-9 s each on an H100) and keeps the result on
# disk, by default under the temporary directory (/tmp/mlx/VERSION/ptx), which many Linux
# hosts empty at boot and which a service with a private /tmp loses at every restart. Workers
# keep it in the project's user cache instead (one folder per MLX version: MLX names the files
# by kernel only), so each kernel is compiled once per install, not once per boot.
PTX_CACHE = "MLX_PTX_CACHE_DIR"


def ptx_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where CUDA workers keep MLX's compiled kernels: the user cache (`shared.paths`), a
    folder per installed MLX version."""
    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = "unknown"
    return cache_dir(environ) / "mlx-ptx" / mlx


def mlx_worker_defaults(env: MutableMapping[str, str]) -> dict[str, str]:
    """MLX's settings as a worker runs it, put into `env` where it has none of its own (off
    cuDNN's attention, off the cache-miss check, kernels in the user cache): for a worker,
    and for a benchmark that times the engine alone as a worker runs it (set before MLX is
    imported). Returns the three as `env` has them now."""
    env.setdefault(CUDNN_SDPA, "0")
    env.setdefault(CACHE_THRASHING_CHECK, "0")
    env.setdefault(PTX_CACHE, str(ptx_cache_dir(env)))
    return {key: env[key] for key in (CUDNN_SDPA, CACHE_THRASHING_CHECK, PTX_CACHE)}


def worker_env(
    setting: str, threads: int = 0, base: dict[str, str] | None = None, device: str = "cpu"
) -> dict[str, str]:
    """The environment for a worker process on `device`, with the BLAS preload and thread
    count applied, and MLX's CUDA backend kept off cuDNN's attention (CUDNN_SDPA) and off
    its lifetime cache-miss check (CACHE_THRASHING_CHECK), its compiled kernels kept in the
    user cache (PTX_CACHE). An OPENBLAS_NUM_THREADS, MLX_CUDA_USE_CUDNN_SDPA,
    MLX_ENABLE_CACHE_THRASHING_CHECK or MLX_PTX_CACHE_DIR already in the environment wins."""
    env = dict(os.environ if base is None else base)
    mlx_worker_defaults(env)
    lib = resolve_blas(setting, device=device)
    if lib:
        existing = env.get("LD_PRELOAD", "")
        if lib not in existing.split(":"):
            env["LD_PRELOAD"] = f"{lib}:{existing}" if existing else lib
        env.setdefault("OPENBLAS_NUM_THREADS", str(blas_thread_count(threads)))
    return env
