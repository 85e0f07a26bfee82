"""worker/lifeline.py: a worker ends with its parent, and a rank 0 under mpirun with the
gateway named in MLX_GATEWAY_PID, whoever its parent is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil

from shared.sharding import GATEWAY_PID_ENV
from tests.gateway_proc import wait_for
from worker.lifeline import gone

# a "gateway" that starts a "worker" (whose lifeline watches every 0.05 s), says its pid, waits;
# the worker says when it watches
_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(60)
    """
)
_WORKER = textwrap.dedent(
    """
    import threading, time
    from worker.lifeline import watch
    watch(threading.Event(), 0.05)
    print("watching", flush=True)
    time.sleep(60)
    """
)


def test_nothing_is_gone_while_parent_and_gateway_live() -> None:
    assert gone(os.getppid(), None) is None
    assert gone(os.getppid(), os.getpid()) is None
    assert gone(os.getppid() + 1, None) == "its parent"


def test_a_gateway_pid_that_no_longer_runs_is_gone() -> None:
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    assert gone(os.getppid(), int(ended.stdout)) == "the gateway"


def _start(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], psutil.Process]:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _WORKER], stdout=subprocess.PIPE, env=env
    )
    assert parent.stdout is not None
    worker = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline() == b"watching\n"  # the worker's, on the same pipe
    return parent, worker


def _ended(process: psutil.Process) -> bool:
    """Exited (a zombie until whatever adopted it reaps it: not this test's to read)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_worker_exits_when_its_parent_dies() -> None:
    parent, worker = _start({**os.environ})
    parent.kill()
    parent.wait()
    wait_for(lambda: _ended(worker), 20, "the worker gone with its parent")


def test_a_worker_exits_when_the_gateway_dies_though_its_parent_lives() -> None:
    gateway = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    parent, worker = _start({**os.environ, GATEWAY_PID_ENV: str(gateway.pid)})
    try:
        wait_for(lambda: worker.is_running() and parent.poll() is None, 5, "both up")
        gateway.kill()
        gateway.wait()
        wait_for(lambda: _ended(worker), 20, "the worker gone with the gateway")
        assert parent.poll() is None  # its parent (mpirun's place) did not go
    finally:
        parent.kill()
        parent.wait()
