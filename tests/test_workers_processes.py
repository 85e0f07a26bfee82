"""gateway/workers/processes.py: real child processes (a stand-in command), their exits,
signals, pid bookkeeping and the wait for Ready."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from gateway.errors import GatewayError
from gateway.workers.control import ControlCalls
from gateway.workers.device import Device
from gateway.workers.processes import Processes
from gateway.workers.slots import WorkerHandle
from gateway.workers.tasks import Tasks
from shared.config import EngineOptions, ModelConfig, ServerConfig
from shared.paths import RunDir
from shared.sharding import Hosts
from tests.worker_fakes import FakeTransport

pytestmark = pytest.mark.anyio


def _processes(
    tmp_path: Path,
    script: str,
    exits: list[WorkerHandle],
    backend: str = "cpu",
    **server: object,
) -> Processes:
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    transport = FakeTransport()
    return Processes(
        ServerConfig(**server),  # type: ignore[arg-type]
        run_dir,
        transport,  # type: ignore[arg-type]
        ControlCalls(),
        Tasks(),
        Device("gpu" if backend == "cuda" else "cpu", backend, 2**34, "a test's"),
        exits.append,
        command=lambda worker_id, model_json: [sys.executable, "-c", script, model_json],
    )


async def _group(tmp_path: Path, script: str) -> tuple[Processes, WorkerHandle]:
    """A two-rank group of `script` (MLX_RANK tells each which it is), spawned."""
    procs = _processes(tmp_path, script, [])
    return procs, await procs.spawn(ModelConfig(name="m", source="/x", shards=2), restart=False)


async def test_a_spawned_worker_is_known_by_id_and_its_pid_saved(tmp_path: Path) -> None:
    exits: list[WorkerHandle] = []
    procs = _processes(tmp_path, "import time; time.sleep(60)", exits)
    handle = await procs.spawn(ModelConfig(name="m", source="/x"), restart=False)
    try:
        assert procs.get(handle.worker_id) is handle and handle.worker_id.startswith("m-1-")
        assert str(handle.pid) in procs.run_dir.workers_file.read_text()
    finally:
        await procs.kill(handle, signal.SIGTERM, grace=5)
    assert handle.exit_code == -signal.SIGTERM
    assert exits == [handle] and procs.get(handle.worker_id) is None
    assert str(handle.pid) not in procs.run_dir.workers_file.read_text()


async def test_a_worker_deaf_to_sigterm_is_killed_after_its_grace(tmp_path: Path) -> None:
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    procs = _processes(tmp_path, script, [])
    handle = await procs.spawn(ModelConfig(name="m", source="/x"), restart=False)
    log = procs.run_dir.worker_log("m")
    while "up" not in log.read_text():  # its handler is set
        await asyncio.sleep(0.01)
    await procs.kill(handle, signal.SIGTERM, grace=0.2)
    assert handle.exit_code == -signal.SIGKILL


async def test_a_worker_that_exits_before_ready_is_a_503_saying_how(tmp_path: Path) -> None:
    procs = _processes(tmp_path, "import sys; sys.exit(3)", [])
    handle = await procs.spawn(ModelConfig(name="m", source="/x"), restart=False)
    with pytest.raises(GatewayError, match=r"failed to load: the worker exited \(exit status 3\)"):
        await procs.wait_ready(handle, timeout=30)


async def test_a_silent_worker_is_a_503_after_the_load_timeout(tmp_path: Path) -> None:
    procs = _processes(tmp_path, "import time; time.sleep(60)", [])
    handle = await procs.spawn(ModelConfig(name="m", source="/x"), restart=False)
    try:
        with pytest.raises(GatewayError, match="did not load within"):
            await procs.wait_ready(handle, timeout=0.1)
    finally:
        await procs.kill(handle, signal.SIGKILL, grace=0)


async def test_the_worker_gets_its_model_with_server_wide_limits_filled_in(
    tmp_path: Path,
) -> None:
    script = "import sys; print(sys.argv[1])"
    procs = _processes(tmp_path, script, [], max_prompt_tokens=1000)
    handle = await procs.spawn(ModelConfig(name="m", source="/x"), restart=False)
    await handle.exited.wait()
    assert '"max_prompt_tokens":1000' in procs.run_dir.worker_log("m").read_text()
    own = ModelConfig(name="m", source="/x", engine=EngineOptions(max_prompt_tokens=50))
    assert procs.worker_model(own).engine.max_prompt_tokens == 50


async def test_groups_over_several_machines_take_the_ring_range_no_running_group_holds(
    tmp_path: Path,
) -> None:
    exits: list[WorkerHandle] = []
    procs = _processes(tmp_path, "import time; time.sleep(60)", exits)
    hosts = Hosts(ranks=["127.0.0.1", "127.0.0.1"], ring_port=40000)
    model = ModelConfig(name="m", source="/x", shards=2, hosts=hosts)

    def ports(handle: WorkerHandle) -> list[str]:
        ring = procs.run_dir.root / f"ring-{handle.worker_id}.json"
        return [node[0] for node in json.loads(ring.read_text())]

    first = await procs.spawn(model, restart=False)
    second = await procs.spawn(model, restart=False)  # a reload: beside the first
    try:
        assert ports(first) == ["127.0.0.1:40000", "127.0.0.1:40001"]
        assert ports(second) == ["127.0.0.1:40002", "127.0.0.1:40003"]
        with pytest.raises(GatewayError, match="ring ports are both in use") as third:
            await procs.spawn(model, restart=False)
        assert third.value.retry_after == 5
        await procs.kill(first, signal.SIGKILL, grace=0)
        fourth = await procs.spawn(model, restart=False)  # the first's range is free again
        assert ports(fourth) == ["127.0.0.1:40000", "127.0.0.1:40001"]
        await procs.kill(fourth, signal.SIGKILL, grace=0)
    finally:
        await procs.kill(second, signal.SIGKILL, grace=0)


async def test_a_rank_that_stops_cleanly_leaves_rank_0_time_to_finish(tmp_path: Path) -> None:
    # the group's stop: the other ranks leave at once, rank 0 once its last frames are out;
    # it is not killed for being last (a rank that crashes still ends the group at once)
    script = (
        "import os, time\n"
        "if os.environ['MLX_RANK'] != '0': raise SystemExit(0)\n"
        "time.sleep(0.5); print('rank 0 finished', flush=True)\n"
    )
    procs, handle = await _group(tmp_path, script)
    handle.retiring = True  # an unload: the group was told to stop
    await asyncio.wait_for(handle.exited.wait(), 20)
    assert "rank 0 finished" in procs.run_dir.worker_log("m").read_text()
    assert handle.exit_code == 0 and handle.error is None


async def test_an_nccl_group_is_refused_before_any_rank_starts_where_it_cannot_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ModelConfig(name="m", source="/x", shards=2, hosts=Hosts(backend="nccl"))
    cpu = _processes(tmp_path, "raise SystemExit(3)", [])
    with pytest.raises(GatewayError, match="needs MLX's CUDA build on NVIDIA GPUs"):
        await cpu.spawn(model, restart=False)
    cuda = _processes(tmp_path, "raise SystemExit(3)", [], backend="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(GatewayError, match="each of the 2 ranks; CUDA_VISIBLE_DEVICES lists 1"):
        await cuda.spawn(model, restart=False)
    assert cpu.by_id == {} and cuda.by_id == {}


async def test_a_rank_killed_by_a_signal_is_named_over_the_peer_that_lost_it(
    tmp_path: Path,
) -> None:
    # rank 0 reports its lost peer and exits first; the rank killed by a signal is the cause
    script = (
        "import os, signal, time\n"
        "if os.environ['MLX_RANK'] == '0': time.sleep(0.3); raise SystemExit(1)\n"
        "time.sleep(0.6); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    _, handle = await _group(tmp_path, script)
    handle.error = "[ring] connection to a peer was lost"  # rank 0's WorkerDead
    await asyncio.wait_for(handle.exited.wait(), 20)
    assert handle.error == (
        "rank 1 of its 2-process group exited (killed by SIGKILL); the group is restarted as a unit"
    )
