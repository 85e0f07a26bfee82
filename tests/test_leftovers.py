"""The leftover-worker pid file, with real processes: listed workers die, anything else in the
file (other processes, garbage) is left alone and never stops a gateway from starting."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.workers.leftovers import reap_leftovers, save_pids


def _sleeper(*marker: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *marker])


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_listed_workers_are_killed_and_other_processes_kept(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    worker = _sleeper("-m", "worker", "--leftover")
    bystander = _sleeper("--not-a-w0rker")
    procs += [worker, bystander]
    path = tmp_path / "workers.json"
    save_pids(path, [worker.pid, bystander.pid])
    assert json.loads(path.read_text()) == [worker.pid, bystander.pid]
    reap_leftovers(path)
    assert worker.wait(10) is not None
    assert bystander.poll() is None


@pytest.mark.parametrize(
    "content", ["", "{not json", "42", '{"pid": 1}', '["1", null, true, -5, 0, 1.5, 99999999]']
)
def test_a_corrupt_pid_file_is_ignored(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], content: str
) -> None:
    worker = _sleeper("-m", "worker", "--leftover")
    procs.append(worker)
    path = tmp_path / "workers.json"
    path.write_text(content)
    reap_leftovers(path)  # must not raise
    reap_leftovers(tmp_path / "missing.json")
    assert worker.poll() is None
