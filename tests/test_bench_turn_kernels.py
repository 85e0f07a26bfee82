"""benchmarks/turn_kernels.py: a turn's window of device kernels from a profiler's trace
(synthetic events here: the recording itself needs PyTorch and a CUDA device)."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import turn_kernels
from benchmarks.turn_kernels import turn_windows


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict[str, object]:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_each_turn_gets_the_kernels_that_started_in_its_window() -> None:
    events = [
        {"cat": "user_annotation", "name": "turn-1", "ts": 5000.0, "dur": 4000.0},
        {"cat": "user_annotation", "name": "turn-0", "ts": 0.0, "dur": 3000.0},
        # the device's copy of a range, and a host call: neither is a kernel nor a turn
        {"cat": "gpu_user_annotation", "name": "turn-0", "ts": 0.0, "dur": 2900.0},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 100.0, "dur": 10.0},
        _kernel("gemm", 500.0, 1000.0),
        _kernel("attention", 1600.0, 400.0),
        _kernel("gemm", 2100.0, 500.0),
        _kernel("copy", 2999.0, 200.0, "gpu_memcpy"),  # starts inside, ends after
        _kernel("late", 3100.0, 50.0),  # between the turns: none of theirs
        _kernel("gemv", 6000.0, 100.0),
    ]
    first, second = turn_windows(events, top=2)
    assert first["turn"] == 0 and second["turn"] == 1
    assert (first["wall_ms"], first["kernels"], first["busy_ms"]) == (3.0, 4, 2.1)
    assert first["span_ms"] == pytest.approx(2.7)  # 500 to 3,199 us
    assert first["first_kernel_ms"] == 0.5
    assert first["idle_ms"] == pytest.approx(0.6)  # the span less the busy time
    assert first["top"] == [["gemm", 2, 1.5], ["attention", 1, 0.4]]
    assert (second["kernels"], second["first_kernel_ms"], second["idle_ms"]) == (1, 1.0, 0.0)


def test_a_turn_without_kernels_says_so() -> None:
    [line] = turn_windows([{"cat": "user_annotation", "name": "turn-3", "ts": 0, "dur": 10}])
    assert (line["turn"], line["kernels"], line["busy_ms"], line["first_kernel_ms"]) == (
        3,
        0,
        0.0,
        None,
    )


@pytest.mark.parametrize(
    "argv", [["--turns", "0"], ["--warm", "-1"], ["--top", "0"], ["--idle-spin"]]
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        turn_kernels.main(["/nonexistent-model", *argv])
    assert exit_info.value.code == 2


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch installed")
def test_without_pytorch_it_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert turn_kernels.main(["/nonexistent-model"]) == 2
    assert "needs PyTorch" in capsys.readouterr().err
