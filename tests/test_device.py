"""The workers' device as the gateway detects it, without mlx: fakes for nvidia-smi and for
the installed distributions."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import pytest

from gateway.workers import device
from gateway.workers.device import Device, detect_device, linux_backend, nvidia_memory

GiB = 2**30
H200_MIB = 143771


class FakeDist:
    """An installed distribution whose RECORD lists libmlx.so with `size` bytes."""

    def __init__(self, root: Path, size: int) -> None:
        self.root = root
        entry = metadata.PackagePath(device.LIBMLX)
        entry.size = size
        self.files = [metadata.PackagePath("mlx/lib/other.h"), entry]

    def locate_file(self, path: metadata.PackagePath) -> Path:
        return self.root / path


def installed(dists: dict[str, Any]) -> Any:
    def distribution(name: str) -> Any:
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]

    return distribution


def smi(stdout: str, returncode: int = 0, calls: list[list[str]] | None = None) -> Any:
    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if calls is not None:
            calls.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout, "")

    return run


@pytest.fixture
def libmlx(tmp_path: Path) -> Path:
    lib = tmp_path / device.LIBMLX
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"x" * 300)  # as written by the backend installed last
    return tmp_path


# ---- which backend is installed --------------------------------------------------------


def test_one_backend(libmlx: Path) -> None:
    assert linux_backend(installed({"mlx-cpu": FakeDist(libmlx, 300)})) == "cpu"
    assert linux_backend(installed({"mlx-cuda-13": FakeDist(libmlx, 300)})) == "cuda"
    assert linux_backend(installed({"mlx-cuda-12": FakeDist(libmlx, 300)})) == "cuda"


def test_no_backend() -> None:
    assert linux_backend(installed({})) is None


def test_both_backends_the_one_whose_libmlx_is_in_place_wins(
    libmlx: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cpu_last = {"mlx-cpu": FakeDist(libmlx, 300), "mlx-cuda-13": FakeDist(libmlx, 9000)}
    assert linux_backend(installed(cpu_last)) == "cpu"
    assert "keep one" in caplog.text and "(mlx-cpu's is in place)" in caplog.text
    cuda_last = {"mlx-cpu": FakeDist(libmlx, 20), "mlx-cuda-13": FakeDist(libmlx, 300)}
    assert linux_backend(installed(cuda_last)) == "cuda"


def test_a_backend_whose_libmlx_is_gone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Uninstalling mlx-cpu deleted the libmlx.so mlx-cuda-13 had overwritten.
    assert linux_backend(installed({"mlx-cuda-13": FakeDist(tmp_path, 9000)})) == "cuda"
    assert "--force-reinstall --no-deps mlx-cuda-13" in caplog.text


def test_the_real_environment_has_a_backend(caplog: pytest.LogCaptureFixture) -> None:
    assert linux_backend() in ("cpu", "cuda")  # the test environment installs mlx[cpu]
    assert not caplog.records  # its libmlx.so is the one its RECORD lists


# ---- nvidia-smi -------------------------------------------------------------------------


def test_nvidia_memory_from_nvidia_smi() -> None:
    calls: list[list[str]] = []
    memory = nvidia_memory(smi(f"{H200_MIB}\n{H200_MIB}\n", calls=calls), environ={})
    assert memory == H200_MIB * 2**20
    assert calls == [["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]]


def test_nvidia_memory_of_the_first_visible_gpu() -> None:
    calls: list[list[str]] = []
    nvidia_memory(smi("81559\n", calls=calls), environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert calls[0][-1] == "--id=2"
    for hidden in ("", "-1", " , 1"):
        assert nvidia_memory(smi("81559\n"), environ={"CUDA_VISIBLE_DEVICES": hidden}) is None


@pytest.mark.parametrize(
    ("stdout", "returncode"),
    [("", 0), ("[N/A]\n", 0), ("0\n", 0), ("No devices were found\n", 6), ("81559\n", 9)],
)
def test_nvidia_memory_without_an_answer(stdout: str, returncode: int) -> None:
    assert nvidia_memory(smi(stdout, returncode), environ={}) is None


def test_nvidia_memory_without_nvidia_smi() -> None:
    def missing(command: list[str], **kwargs: Any) -> Any:
        raise FileNotFoundError(command[0])

    def hangs(command: list[str], **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    assert nvidia_memory(missing, environ={}) is None
    assert nvidia_memory(hangs, environ={}) is None


# ---- the device -------------------------------------------------------------------------


def fake_machine(monkeypatch: pytest.MonkeyPatch, backend: str | None, gpu: int | None) -> None:
    monkeypatch.setattr(device, "linux_backend", lambda: backend)
    monkeypatch.setattr(device, "nvidia_memory", lambda: gpu)


def test_cuda_backend_and_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_machine(monkeypatch, "cuda", 141 * GiB)
    assert detect_device("linux") == Device("gpu", "cuda", 141 * GiB, "nvidia-smi")


def test_cuda_backend_without_a_gpu_plans_for_the_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_machine(monkeypatch, "cuda", None)
    ram = psutil.virtual_memory().total
    assert detect_device("linux") == Device("cpu", "cpu", ram, "host RAM")
    assert "nvidia-smi finds no GPU" in caplog.text


def test_cpu_backend_on_a_gpu_machine_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_machine(monkeypatch, "cpu", 141 * GiB)
    assert detect_device("linux").kind == "cpu"


def test_no_backend_is_an_error_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_machine(monkeypatch, None, None)
    assert detect_device("linux").kind == "cpu"
    assert "mlx-gateway[cpu]" in caplog.text and "mlx-gateway[cuda]" in caplog.text


def test_mac_is_metal_with_unified_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_machine(monkeypatch, "cuda", 141 * GiB)  # never asked on macOS
    ram = psutil.virtual_memory().total
    assert detect_device("darwin") == Device("gpu", "metal", ram, "unified memory")


def test_this_machine_is_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi, whatever is installed
    assert detect_device("linux").kind == "cpu"
