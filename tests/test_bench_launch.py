"""benchmarks/_launch.py: an in-process benchmark re-executed under a worker's environment."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import pytest

from benchmarks import _launch
from shared.blas import PTX_CACHE, worker_env

# as_worker's device: the environment it builds is a CPU worker's or a GPU worker's
DEVICE = "cpu" if mx.default_device() == mx.cpu else "gpu"


class Execve(Exception):
    pass


def _execve(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], dict[str, str]]]:
    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(path: str, args: list[str], env: dict[str, str]) -> Any:
        calls.append((path, args, env))
        raise Execve

    monkeypatch.setattr(_launch.os, "execve", execve)
    monkeypatch.delenv(_launch.AS_WORKER)  # set for every test (conftest)
    monkeypatch.delenv(PTX_CACHE, raising=False)  # one of the worker's settings missing
    return calls


def test_a_benchmark_runs_again_under_the_workers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _execve(monkeypatch)
    with pytest.raises(Execve):
        _launch.as_worker("benchmarks.cached_turns", ["/model", "--turns", "2"])
    [(path, args, env)] = calls
    assert path == sys.executable
    assert args == [path, "-m", "benchmarks.cached_turns", "/model", "--turns", "2"]
    expected = worker_env("auto", device=DEVICE)  # on a CPU, OpenBLAS where it is found
    assert env[_launch.AS_WORKER] == "1"
    assert env.get("LD_PRELOAD") == expected.get("LD_PRELOAD")
    assert env[PTX_CACHE] == expected[PTX_CACHE]


def test_from_the_command_line_it_runs_the_same_command_line_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _execve(monkeypatch)
    command = ["python", "-X", "faulthandler", "-m", "cProfile", "-m", "benchmarks.x", "a b"]
    monkeypatch.setattr(_launch.sys, "orig_argv", command)
    with pytest.raises(Execve):
        _launch.as_worker("benchmarks.x", None)
    assert calls[0][1] == [sys.executable, *command[1:]]  # the profiler's wrapper kept


def test_once_re_executed_or_already_so_it_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    _launch.as_worker("benchmarks.cached_turns", [])  # the tests' own setting (conftest)
    assert _launch.AS_WORKER not in _launch.without_as_worker()  # servers it launches
    calls = _execve(monkeypatch)
    for key, value in worker_env("auto", device=DEVICE).items():
        monkeypatch.setenv(key, value)  # started with everything a worker has
    _launch.as_worker("benchmarks.cached_turns", [])
    assert calls == []
