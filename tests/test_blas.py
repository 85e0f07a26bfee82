"""resolve_blas and the worker environment: LD_PRELOAD and MLX's settings."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from shared.blas import BlasError, ptx_cache_dir, resolve_blas, worker_env
from shared.paths import cache_dir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


@pytest.fixture
def libs(tmp_path: Path) -> tuple[str, str, str]:
    first, second = tmp_path / "libfirst.so.0", tmp_path / "libsecond.so.0"
    first.write_bytes(b"\x7fELF")
    second.write_bytes(b"\x7fELF")
    return str(tmp_path / "missing.so.0"), str(first), str(second)


def test_off(libs: tuple[str, str, str]) -> None:
    _, first, _ = libs
    assert resolve_blas("off", (first,)) is None


def test_auto_picks_the_first_existing_candidate(libs: tuple[str, str, str]) -> None:
    missing, first, second = libs
    assert resolve_blas("auto", (missing, second, first)) == second
    assert resolve_blas("auto", (first, second)) == first


def test_auto_without_candidates(libs: tuple[str, str, str], tmp_path: Path) -> None:
    missing, _, _ = libs
    assert resolve_blas("auto", (missing,)) is None
    assert resolve_blas("auto", ()) is None
    assert resolve_blas("auto", (str(tmp_path),)) is None  # a directory is no library


def test_explicit_path(libs: tuple[str, str, str]) -> None:
    missing, first, second = libs
    assert resolve_blas(second, (first,)) == second
    with pytest.raises(BlasError, match=r"missing\.so\.0"):
        resolve_blas(missing, (first,))


NO_CUDNN = {
    "MLX_CUDA_USE_CUDNN_SDPA": "0",
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    "MLX_PTX_CACHE_DIR": str(ptx_cache_dir({})),
}


def test_worker_env_sets_ld_preload(libs: tuple[str, str, str]) -> None:
    _, first, _ = libs
    env = worker_env(first, 3, base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "LD_PRELOAD": first, "OPENBLAS_NUM_THREADS": "3"} | NO_CUDNN


def test_worker_env_prepends_to_an_existing_preload(libs: tuple[str, str, str]) -> None:
    _, first, second = libs
    base = {"LD_PRELOAD": second}
    env = worker_env(first, base=base)
    assert env["LD_PRELOAD"] == f"{first}:{second}"
    assert base == {"LD_PRELOAD": second}  # the base is not modified


def test_worker_env_does_not_preload_twice(libs: tuple[str, str, str]) -> None:
    _, first, second = libs
    base = {"LD_PRELOAD": f"{second}:{first}"}
    assert worker_env(first, base=base)["LD_PRELOAD"] == f"{second}:{first}"


def test_worker_env_off_leaves_the_environment(libs: tuple[str, str, str]) -> None:
    _, _, second = libs
    assert (
        worker_env("off", base={"LD_PRELOAD": second, "A": "1"})
        == {
            "LD_PRELOAD": second,
            "A": "1",
        }
        | NO_CUDNN
    )
    assert "LD_PRELOAD" not in worker_env("off", base={"A": "1"})


def test_worker_env_missing_library_is_an_error(libs: tuple[str, str, str]) -> None:
    missing, _, _ = libs
    with pytest.raises(BlasError):
        worker_env(missing, base={})


def test_worker_env_defaults_to_os_environ(
    libs: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, first, second = libs
    monkeypatch.setenv("MLX_GATEWAY_TEST_MARKER", "yes")
    monkeypatch.setenv("LD_PRELOAD", second)
    env = worker_env(first)
    assert env["MLX_GATEWAY_TEST_MARKER"] == "yes"
    assert env["LD_PRELOAD"] == f"{first}:{second}"

    assert os.environ["LD_PRELOAD"] == second  # os.environ itself is untouched


def test_blas_threads_auto_is_half_the_cores() -> None:
    from shared.blas import blas_thread_count

    assert blas_thread_count(0, cpus=2) == 1
    assert blas_thread_count(0, cpus=16) == 8
    assert blas_thread_count(0, cpus=1) == 1
    assert blas_thread_count(4, cpus=2) == 4


def test_user_openblas_threads_win(libs: tuple[str, str, str]) -> None:
    _, first, _ = libs
    env = worker_env(first, 1, base={"OPENBLAS_NUM_THREADS": "7"})
    assert env["OPENBLAS_NUM_THREADS"] == "7"


# ---- only for MLX's CPU device -------------------------------------------------------------


def test_auto_preloads_into_cpu_workers_only(libs: tuple[str, str, str]) -> None:
    _, first, _ = libs
    assert resolve_blas("auto", (first,), device="cpu") == first
    assert resolve_blas("auto", (first,), device="gpu") is None
    assert resolve_blas("auto", (first,)) == first  # the CPU unless told otherwise


def test_gpu_worker_env_has_no_preload(
    libs: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared import blas

    _, first, _ = libs
    monkeypatch.setattr(blas, "CANDIDATES", (first,))
    assert worker_env("auto", 1, base={"PATH": "/bin"}, device="cpu")["LD_PRELOAD"] == first
    env = worker_env("auto", 1, base={"PATH": "/bin"}, device="gpu")
    assert env == {"PATH": "/bin"} | NO_CUDNN  # no LD_PRELOAD, no OPENBLAS_NUM_THREADS


def test_an_explicit_library_is_preloaded_on_any_device(libs: tuple[str, str, str]) -> None:
    _, first, _ = libs
    assert (
        worker_env(first, 2, base={}, device="gpu")
        == {
            "LD_PRELOAD": first,
            "OPENBLAS_NUM_THREADS": "2",
        }
        | NO_CUDNN
    )


@pytest.mark.parametrize(("backend", "preloaded"), [("cuda", False), ("cpu", True)])
def test_the_supervisor_spawns_for_the_detected_device(
    libs: tuple[str, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    preloaded: bool,
) -> None:
    """On a CUDA machine (faked) workers get no OpenBLAS; on MLX's CPU they do."""
    from gateway.workers import device, processes, supervisor
    from shared import blas
    from shared.config import Config, ModelConfig
    from shared.paths import RunDir

    _, first, _ = libs
    monkeypatch.setattr(blas, "CANDIDATES", (first,))
    monkeypatch.setattr(device, "linux_backend", lambda: backend)
    monkeypatch.setattr(device, "nvidia_memory", lambda: 80 * 2**30)
    monkeypatch.setattr(supervisor, "detect_device", lambda: device.detect_device("linux"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    envs: list[dict[str, str]] = []
    real_exec = asyncio.create_subprocess_exec

    async def spawn(*args: str, **kwargs: Any) -> asyncio.subprocess.Process:
        envs.append(kwargs["env"])
        return await real_exec("true", **kwargs)  # exits at once: a load failure

    monkeypatch.setattr(processes.asyncio, "create_subprocess_exec", spawn)

    async def main() -> None:
        sup = supervisor.Supervisor(Config(), RunDir(tmp_path / "run"))
        sup.run_dir.create()
        model = ModelConfig(name="m", source="/nowhere")
        handle = await sup.processes.spawn(model, restart=False)
        await asyncio.wait_for(handle.exited.wait(), 10)
        assert sup.device.kind == ("gpu" if backend == "cuda" else "cpu")
        assert sup.status()["device"] == f"{sup.device.kind} ({backend})"

    asyncio.run(main())
    assert ("LD_PRELOAD" in envs[0]) is preloaded
    if preloaded:
        assert envs[0]["LD_PRELOAD"] == first


def test_workers_run_without_cudnn_attention_unless_the_environment_says() -> None:
    assert worker_env("off", base={})["MLX_CUDA_USE_CUDNN_SDPA"] == "0"
    mine = {"MLX_CUDA_USE_CUDNN_SDPA": "1"}
    assert worker_env("off", base=mine)["MLX_CUDA_USE_CUDNN_SDPA"] == "1"


def test_workers_run_without_mlx_cache_thrashing_check_unless_the_environment_says() -> None:
    assert worker_env("off", base={})["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    mine = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    assert worker_env("off", base=mine)["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "1"


# More convolution shapes than twice the cache MLX's CUDA backend keeps for them (8 here).
THRASH = """
import mlx.core as mx
w = mx.ones((4, 3, 8))
for n in range(3, 40):
    mx.eval(mx.conv1d(mx.ones((1, n, 8)), w))
print("survived")
"""


@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend keeps these caches")
def test_a_cuda_worker_outlives_more_new_shapes_than_mlx_caches_hold() -> None:
    """With MLX's check on, a process raises once a cache has missed twice its capacity in
    its life; a worker's environment turns the check off, and the same process lives on."""
    small = {"MLX_CUDA_CONV_CACHE_SIZE": "8"}

    def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", THRASH], env=env, capture_output=True, text=True, timeout=300
        )

    checked = run(worker_env("off") | small | {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"})
    assert checked.returncode != 0 and "Cache thrashing" in checked.stderr
    survived = run(worker_env("off") | small)
    assert survived.returncode == 0, survived.stderr[-2000:]
    assert "survived" in survived.stdout


def test_workers_keep_mlx_compiled_kernels_in_the_user_cache_per_mlx_version(
    tmp_path: Path,
) -> None:
    env = worker_env("off", base={"MLX_GATEWAY_CACHE_DIR": str(tmp_path)})
    assert env["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mlx-ptx" / version("mlx"))
    default = Path(worker_env("off", base={})["MLX_PTX_CACHE_DIR"])
    assert default == cache_dir({}) / "mlx-ptx" / version("mlx")
    assert not str(default).startswith(tempfile.gettempdir())  # not emptied at boot
    mine = {"MLX_PTX_CACHE_DIR": str(tmp_path / "mine")}
    assert worker_env("off", base=mine)["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mine")


# A gather along an axis: MLX's CUDA backend compiles its kernels at first use (NVRTC).
GATHER = """
import mlx.core as mx
x = mx.ones((4, 8, 16), dtype=mx.bfloat16)
mx.eval(mx.take_along_axis(x, mx.zeros((4, 8, 16), dtype=mx.int32), axis=2))
print("gathered")
"""


@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend compiles these")
def test_a_cuda_worker_keeps_the_kernels_it_compiles_in_the_user_cache(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env = worker_env("off", base=base | {"MLX_GATEWAY_CACHE_DIR": str(tmp_path)})
    done = subprocess.run(
        [sys.executable, "-c", GATHER], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    kept = list((tmp_path / "mlx-ptx" / version("mlx")).glob("gather_axis_*.ptx"))
    assert kept, sorted(p.name for p in tmp_path.rglob("*"))


def test_mlx_worker_defaults_fill_only_what_is_unset(tmp_path: Path) -> None:
    from shared.blas import CACHE_THRASHING_CHECK, CUDNN_SDPA, PTX_CACHE, mlx_worker_defaults

    env = {CUDNN_SDPA: "1", "MLX_GATEWAY_CACHE_DIR": str(tmp_path)}
    said = mlx_worker_defaults(env)
    assert said == {CUDNN_SDPA: "1", CACHE_THRASHING_CHECK: "0", PTX_CACHE: env[PTX_CACHE]}
    assert env[PTX_CACHE].startswith(str(tmp_path))
    assert mlx_worker_defaults({})[CUDNN_SDPA] == "0"
