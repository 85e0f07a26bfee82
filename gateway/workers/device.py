"""The device the workers will run on, known before the first one starts.

The gateway never imports mlx, so it reads what is installed and what the machine has:
- macOS: MLX's Metal GPU, whose memory is the machine's unified memory;
- Linux with MLX's CUDA backend installed (the mlx-cuda-13 or mlx-cuda-12 distribution) and
  an NVIDIA GPU that `nvidia-smi` answers for: the GPU, with the memory nvidia-smi reports
  for the first GPU in CUDA_VISIBLE_DEVICES (GPU 0 when unset), where MLX runs;
- otherwise Linux: MLX's CPU device, with host RAM.

It decides the OpenBLAS preload (CPU workers only) and the memory budget's starting point;
each worker's Ready then reports the device MLX actually chose and its memory, and the budget
follows that (gateway/workers/memory.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import psutil

log = logging.getLogger("gateway.workers.supervisor")

# MLX's Linux backends, one distribution each; all of them install mlx/lib/libmlx.so.
BACKENDS = {"mlx-cuda-13": "cuda", "mlx-cuda-12": "cuda", "mlx-cpu": "cpu"}
LIBMLX = "mlx/lib/libmlx.so"
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "gpu" or "cpu", as a worker's Ready says it
    backend: str  # "metal", "cuda" or "cpu"
    memory_bytes: int  # what the device holds
    memory_source: str  # where that figure comes from


def detect_device(platform: str = sys.platform) -> Device:
    ram = psutil.virtual_memory().total
    if platform == "darwin":
        return Device("gpu", "metal", ram, "unified memory")
    backend = linux_backend()
    if backend is None:
        log.error(
            "MLX has no backend installed (unless it was built from source): workers will "
            "fail to import it. Install mlx-gateway[cpu], or mlx-gateway[cuda] for NVIDIA GPUs"
        )
    if backend == "cuda":
        memory = nvidia_memory()
        if memory is not None:
            return Device("gpu", "cuda", memory, "nvidia-smi")
        log.warning(
            "MLX's CUDA backend is installed but nvidia-smi finds no GPU: planning for MLX's "
            "CPU device until a worker reports its own"
        )
    return Device("cpu", "cpu", ram, "host RAM")


def linux_backend(
    distribution: Callable[[str], Any] = metadata.distribution,
) -> str | None:
    """Which MLX backend is installed: "cuda", "cpu", or None. Their libmlx.so is one file:
    with several installed, the one whose file is in place (the last installed) counts."""
    found = {}
    for name in BACKENDS:
        try:
            found[name] = distribution(name)
        except metadata.PackageNotFoundError:
            continue
    if not found:
        return None
    in_place = [name for name, dist in found.items() if _libmlx_in_place(dist)]
    names = " ".join(found)
    if len(found) > 1:
        log.warning(
            "MLX backends %s are all installed and share %s (%s's is in place); keep one: "
            "pip uninstall -y %s, then pip install 'mlx-gateway[cpu]' or 'mlx-gateway[cuda]'",
            names,
            LIBMLX,
            " and ".join(in_place) or "nobody",
            names,
        )
    if not in_place:
        log.error(
            "%s is missing or not the one %s installed (removed with another backend?): "
            "workers will fail to import MLX. Reinstall: pip install --force-reinstall "
            "--no-deps %s",
            LIBMLX,
            names,
            next(iter(found)),
        )
    return BACKENDS[(in_place or list(found))[0]]


def _libmlx_in_place(dist: Any) -> bool:
    """Whether the libmlx.so on disk is the one this distribution's RECORD lists."""
    entry = next((f for f in dist.files or () if f.as_posix() == LIBMLX), None)
    if entry is None:
        return True  # nothing to compare with
    try:
        size = os.stat(dist.locate_file(entry)).st_size
    except OSError:
        return False
    return entry.size is None or bool(size == entry.size)


def nvidia_memory(
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
    environ: Mapping[str, str] = os.environ,
) -> int | None:
    """Total memory in bytes of the GPU MLX will use (the first one CUDA_VISIBLE_DEVICES
    shows), from nvidia-smi; None when there is no such GPU or nvidia-smi does not answer."""
    command = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if not first or first.startswith("-"):
            return None  # CUDA hides every GPU
        command.append(f"--id={first}")
    try:
        out = run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split() if out.returncode == 0 else []
    try:
        mib = int(lines[0])
    except (IndexError, ValueError):  # no GPU, or "[N/A]"
        return None
    return mib * 2**20 if mib > 0 else None
