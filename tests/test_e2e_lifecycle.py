"""The gateway's own life: workers never outlive it, and a new gateway cleans up after one."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.gateway_proc import GatewayProc


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.1)
    assert _gone(pid), f"worker {pid} outlived its gateway"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_exit_with_the_gateway(other_model: Path, sig: signal.Signals) -> None:
    gw = GatewayProc([{"name": "m", "source": str(other_model)}])
    try:
        gw.wait_ready(["m"])
        pid = gw.ps()["m"]["pid"]
        gw.proc.send_signal(sig)
        gw.proc.wait(30)
        # SIGTERM: the lifespan unloads; SIGKILL: the worker notices its parent is gone.
        _wait_gone(pid, 15)
    finally:
        gw.stop()
