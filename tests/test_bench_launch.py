"""benchmarks/_launch.py: an in-process benchmark re-executed under a worker's environment."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from benchmarks import _launch
from shared.blas import PTX_CACHE, worker_env


class Execve(Exception):
    pass


def _execve(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], dict[str, str]]]:
    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(path: str, args: list[str], env: dict[str, str]) -> Any:
        calls.append((path, args, env))
        raise Execve

    monkeypatch.setattr(_launch.os, "execve", execve)
    return calls


def test_a_benchmark_runs_again_under_the_workers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _execve(monkeypatch)
    monkeypatch.delenv(_launch.AS_WORKER)
    monkeypatch.delenv(PTX_CACHE, raising=False)  # one of the worker's settings missing
    with pytest.raises(Execve):
        _launch.as_worker("benchmarks.cached_turns", ["/model", "--turns", "2"])
    [(path, args, env)] = calls
    assert (path, args) == (
        sys.executable,
        [path, "-m", "benchmarks.cached_turns", "/model", "--turns", "2"],
    )
    expected = worker_env("auto", device="cpu")  # MLX's CPU device here: OpenBLAS if found
    assert env[_launch.AS_WORKER] == "1"
    assert env.get("LD_PRELOAD") == expected.get("LD_PRELOAD")
    assert env[PTX_CACHE] == expected[PTX_CACHE]


def test_once_re_executed_or_already_so_it_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _execve(monkeypatch)
    _launch.as_worker("benchmarks.cached_turns", [])  # the tests' own setting (conftest)
    assert _launch.AS_WORKER not in _launch.without_as_worker()  # servers it launches
    monkeypatch.delenv(_launch.AS_WORKER)
    for key, value in worker_env("auto", device="cpu").items():
        monkeypatch.setenv(key, value)  # started with everything a worker has
    _launch.as_worker("benchmarks.cached_turns", [])
    assert calls == []
