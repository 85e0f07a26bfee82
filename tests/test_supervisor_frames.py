"""How the Supervisor routes worker frames: the handshake (Hello, then Ready) counts once; a
Hello or Ready that comes after it, or from a worker nobody spawned, is logged and ignored."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import cast

import pytest

from gateway.workers.slots import WorkerHandle
from gateway.workers.supervisor import Supervisor
from shared.config import Config, ModelConfig
from shared.paths import RunDir
from shared.protocol import PROTOCOL_VERSION, Capacity, Hello, Ready, StepOutputs
from shared.types import RequestOutput
from tests.worker_fakes import FakeProcess

pytestmark = pytest.mark.anyio

MODEL = ModelConfig(name="m", source="/nowhere")


def supervised(tmp_path: Path) -> tuple[Supervisor, WorkerHandle, FakeProcess]:
    sup = Supervisor(Config(models=[MODEL]), RunDir(tmp_path / "run"))
    process = FakeProcess()
    handle = WorkerHandle(MODEL, "m-1", cast(asyncio.subprocess.Process, process))
    sup.processes.by_id[handle.worker_id] = handle
    return sup, handle, process


async def test_a_handshake_after_ready_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second Hello of another protocol version once ended a worker that had long been
    serving (and a second Ready could zero its capacity): neither is a real worker's."""
    sup, handle, process = supervised(tmp_path)
    ready = Ready("m-1", Capacity(4, 8, 1024))
    sup._on_local(Hello("m-1", PROTOCOL_VERSION, process.pid, "m"))
    sup._on_local(ready)
    with caplog.at_level(logging.WARNING):
        sup._on_local(Hello("m-1", PROTOCOL_VERSION + 1, 1, "m"))
        sup._on_local(Ready("m-1", Capacity(0, 0, 0)))
    assert handle.info is ready and handle.capacity == Capacity(4, 8, 1024)
    assert handle.error is None and process.signals == []
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        "model m: Hello from its worker after Ready: ignored",
        "model m: Ready from its worker after Ready: ignored",
    ]


async def test_a_first_hello_of_another_version_still_ends_the_worker(tmp_path: Path) -> None:
    sup, handle, process = supervised(tmp_path)
    sup._on_local(Hello("m-1", PROTOCOL_VERSION + 1, process.pid, "m"))
    await asyncio.sleep(0)  # the kill task runs
    assert (
        handle.error == f"protocol version {PROTOCOL_VERSION + 1} != gateway's {PROTOCOL_VERSION}"
    )
    assert process.signals == [signal.SIGTERM]
    sup.tasks.cancel_all()


async def test_frames_from_workers_nobody_spawned_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sup, handle, _ = supervised(tmp_path)
    with caplog.at_level(logging.WARNING):
        sup._on_local(Hello("stranger", PROTOCOL_VERSION + 1, 7, "x" * 1000))
        sup._on_local(StepOutputs("stranger", 1, [RequestOutput("r")]))
        sup._on_local(Ready("stranger", Capacity(1, 1, 1)))
    assert handle.info is None and handle.step == -1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("hello from unknown worker 'stranger' (pid 7, model 'xxx")
    assert warning.endswith(f"protocol {PROTOCOL_VERSION + 1}): ignored")
    assert len(warning) < 250  # a peer's strings are cut short in the log
