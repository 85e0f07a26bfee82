"""Optimized BLAS for MLX's CPU backend on Linux.

mlx[cpu] wheels for Linux bundle the reference BLAS; preloading an optimized one (Debian's
libopenblas0-pthread) makes batched matmuls an order of magnitude faster. The preload must be
in the environment before the worker process starts, so the supervisor decides it at spawn.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


class BlasError(ValueError):
    pass


def resolve_blas(setting: str, candidates: tuple[str, ...] = CANDIDATES) -> str | None:
    """The library to preload for `setting` (auto | off | a path), or None."""
    if not sys.platform.startswith("linux") or setting == "off":
        return None
    if setting == "auto":
        return next((c for c in candidates if Path(c).is_file()), None)
    if not Path(setting).is_file():
        raise BlasError(f"blas library not found: {setting}")
    return setting


def worker_env(setting: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker process, with the BLAS preload applied."""
    env = dict(os.environ if base is None else base)
    lib = resolve_blas(setting)
    if lib:
        existing = env.get("LD_PRELOAD", "")
        if lib not in existing.split(":"):
            env["LD_PRELOAD"] = f"{lib}:{existing}" if existing else lib
    return env
