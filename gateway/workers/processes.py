"""Worker processes: spawning one for a model, waiting for its Ready, signalling it, and
noticing its exit. Each worker is known by its id; the pids of those alive are saved for a
restarted gateway to reap (leftovers). What an exit means is for the caller (`on_exit`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from gateway.errors import GatewayError
from gateway.workers.control import ControlCalls
from gateway.workers.device import Device
from gateway.workers.leftovers import save_pids
from gateway.workers.slots import WorkerHandle, describe_exit
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.blas import worker_env
from shared.config import ModelConfig, ServerConfig
from shared.paths import RunDir
from shared.sharding import (
    GATEWAY_PID_ENV,
    HOSTFILE_ENV,
    MPI_LIBNAME_ENV,
    RANK_ENV,
    VISIBLE_GPUS_ENV,
    agent_script,
    find_libmpi,
    hostfile,
    mpi_launch,
    nccl_env,
    remote_argv,
    ring_hostfile,
    runs_here,
)
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.processes")


def worker_argv(worker_id: str, model_json: str, *where: str) -> list[str]:
    """`python -m worker`: its id, how it reaches the gateway (`where`), its model."""
    return [sys.executable, "-m", "worker", "--id", worker_id, *where, "--model", model_json]


def free_port() -> int:
    """A TCP port free on loopback now (for a sharded model's ranks to listen on)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# How long rank 0 has to leave once another rank of its group stopped cleanly
CLEAN_EXIT_S = 10.0
# how long a group's other ranks get to end by themselves once one has (a lost ring peer is
# seen at once): which of them was the cause is told from how each ended
SETTLE_S = 2.0

# The command line of a worker: (worker id, the model's config as JSON) -> argv.
Command = Callable[[str, str], list[str]]


class Processes:
    def __init__(
        self,
        server: ServerConfig,
        run_dir: RunDir,
        transport: Transport,
        calls: ControlCalls,
        tasks: Tasks,
        device: Device,
        on_exit: Callable[[WorkerHandle], None],
        command: Command | None = None,
    ) -> None:
        self.server = server
        self.run_dir = run_dir
        self.transport = transport
        self.calls = calls
        self.tasks = tasks
        self.device = device  # what the workers will run on (gateway/workers/device.py)
        self.on_exit = on_exit
        self.command = command or self._worker_command
        self.by_id: dict[str, WorkerHandle] = {}
        self._ring_ranges: dict[str, int] = {}  # groups over several machines: their ports
        self._agents: dict[str, Path] = {}  # MPI groups over several machines: ssh's script
        self._serial = itertools.count(1)

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self.by_id.get(worker_id)

    def alive(self) -> list[WorkerHandle]:
        return list(self.by_id.values())

    def _worker_command(self, worker_id: str, model_json: str) -> list[str]:
        return worker_argv(
            worker_id,
            model_json,
            "--requests",
            self.transport.requests_addr,
            "--outputs",
            self.transport.outputs_addr,
        )

    def worker_model(self, model: ModelConfig) -> ModelConfig:
        """The model's config as its worker sees it: server-wide request limits filled in."""
        limit = self.server.max_prompt_tokens
        if limit is None or model.engine.max_prompt_tokens is not None:
            return model
        engine = msgspec.structs.replace(model.engine, max_prompt_tokens=limit)
        return msgspec.structs.replace(model, engine=engine)

    async def spawn(self, model: ModelConfig, restart: bool) -> WorkerHandle:
        worker_id = f"{model.name}-{next(self._serial)}-{uuid.uuid4().hex[:6]}"
        server = self.server
        argv = self.command(worker_id, msgspec.json.encode(self.worker_model(model)).decode())
        env = worker_env(server.blas, server.blas_threads, device=self.device.kind)
        ranks = [(argv, env, True)]  # each rank's command line, environment, and whether here
        if model.shards > 1 and model.hosts.backend == "mpi":  # mpirun starts the ranks
            ranks = [(*self._mpirun(model, worker_id, argv, env), True)]
        elif model.shards > 1 and model.hosts.backend == "nccl":  # this machine, a GPU each
            if self.device.backend != "cuda":  # said here: each rank would fail alike, in a race
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"model {model.name!r}: hosts.backend = 'nccl' needs MLX's CUDA build on "
                    f"NVIDIA GPUs (pip install 'mlx-gateway[cuda]'); MLX runs on "
                    f"{self.device.backend} here",
                )
            port, visible = free_port(), os.environ.get(VISIBLE_GPUS_ENV)
            try:
                each = [nccl_env(r, model.shards, port, visible) for r in range(model.shards)]
            except ValueError as exc:
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE, f"model {model.name!r}: {exc}"
                ) from exc
            ranks = [(argv, {**env, **one}, True) for one in each]
        elif model.shards > 1:  # one group: every rank the same command, its own MLX_RANK
            hosts = model.hosts
            if hosts.ranks:  # fixed ports: a group beside a running one takes the other range
                group = ring_hostfile(hosts, self._ring_range(model.name, worker_id))
            else:
                group = hostfile([free_port() for _ in range(model.shards)])
            group_file = self.run_dir.root / f"ring-{worker_id}.json"
            group_file.write_text(group)
            ranks = [
                (argv, {**env, RANK_ENV: str(rank), HOSTFILE_ENV: str(group_file)}, True)
                if runs_here(hosts, rank)
                else (remote_argv(hosts, rank, argv, group, env), env, False)
                for rank in range(model.shards)
            ]
        log_file = open(self.run_dir.worker_log(model.name), "ab")  # noqa: SIM115
        processes: list[asyncio.subprocess.Process] = []
        try:
            for rank_argv, rank_env, here in ranks:
                processes.append(
                    await asyncio.create_subprocess_exec(
                        *rank_argv,
                        # a rank over ssh keeps the client's input open: closing it (the
                        # client ends) hangs the remote terminal up, and the rank exits
                        stdin=asyncio.subprocess.DEVNULL if here else asyncio.subprocess.PIPE,
                        stdout=log_file,
                        stderr=log_file,
                        env=rank_env,
                        start_new_session=True,
                    )
                )
        except BaseException:  # a rank that cannot start: the ones started go with it
            self._ring_ranges.pop(worker_id, None)
            self._forget_agent(worker_id)
            for started in processes:
                with contextlib.suppress(ProcessLookupError):
                    started.kill()
            raise
        finally:
            log_file.close()
        process = processes[0]
        handle = WorkerHandle(model, worker_id, process, restart=restart, ranks=processes[1:])
        self.by_id[worker_id] = handle
        self._save_pids()
        self.tasks.spawn(self._watch_exit(handle))
        log.info("model %s: worker %s spawned (pid %d)", model.name, worker_id, process.pid)
        return handle

    def _mpirun(
        self, model: ModelConfig, worker_id: str, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """The mpirun command of a group over MPI and its environment (rank 0 watches this
        process's pid); what it lacks is the load's error."""
        mpirun = model.hosts.mpirun[0]
        if shutil.which(mpirun) is None:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {model.name!r}: hosts.backend = 'mpi' needs Open MPI's {mpirun!r}, "
                "which is not on this machine (brew install open-mpi; apt install openmpi-bin)",
            )
        libmpi = env.get(MPI_LIBNAME_ENV) or find_libmpi(mpirun)
        if libmpi is None:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {model.name!r}: no libmpi found beside {mpirun!r} nor on the system's "
                f"library path (set {MPI_LIBNAME_ENV} to its path)",
            )
        agent = None
        if model.hosts.ranks:  # the ssh command, as a script: a path is all mpirun takes whole
            folder = Path(tempfile.mkdtemp(prefix="mlx-gateway-ssh-"))
            self._agents[worker_id] = folder
            script = folder / "ssh"
            script.write_text(agent_script(model.hosts))
            script.chmod(0o700)
            agent = str(script)
        env = {**env, GATEWAY_PID_ENV: str(os.getpid())}
        return mpi_launch(model.hosts, model.shards, argv, env, libmpi, agent)

    async def wait_ready(self, handle: WorkerHandle, timeout: float) -> None:
        """Until its Ready; a worker that exits or stays silent first is a 503 saying why."""
        ready = asyncio.ensure_future(handle.ready.wait())
        exited = asyncio.ensure_future(handle.exited.wait())
        try:
            await asyncio.wait({ready, exited}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            ready.cancel()
            exited.cancel()
        if handle.is_ready:
            return
        name = handle.config.name
        if not handle.exited.is_set():
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {name!r} did not load within server.load_timeout_s={timeout:g}s",
                retry_after=5,
            )
        reason = handle.error or f"the worker exited ({describe_exit(handle.exit_code)})"
        raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {name!r} failed to load: {reason}")

    async def kill(self, handle: WorkerHandle, sig: int, grace: float) -> None:
        """Signal it; SIGKILL if it has not exited after `grace` seconds. Returns once gone."""
        assert handle.process is not None, "only a local worker is signalled"
        for process in [handle.process, *handle.ranks]:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
        try:
            await asyncio.wait_for(handle.exited.wait(), grace or 0.001)
        except TimeoutError:
            for process in [handle.process, *handle.ranks]:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await handle.exited.wait()

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        assert handle.process is not None
        if handle.ranks:
            handle.exit_code = await self._watch_group(handle)
        else:
            handle.exit_code = await handle.process.wait()
        # mpirun's ranks end with it, even killed with SIGKILL (they lose its PMIx server; a
        # stopped one is hung up by the kernel with its orphaned process group)
        mpi = handle.config.shards > 1 and handle.config.hosts.backend == "mpi"
        if mpi and handle.exit_code and not handle.retiring and not handle.killed:
            group = (
                f"its {handle.config.shards}-rank MPI group exited "
                f"({describe_exit(handle.exit_code)}: mpirun ends the group when a rank "
                "dies; the worker log says which); the group is restarted as a unit"
            )
            # what rank 0 said first may be a peer's loss, not the cause: both are told
            said = handle.error
            handle.error = f"{group}; rank 0 reported: {said}" if said else group
        self.by_id.pop(handle.worker_id, None)
        self._ring_ranges.pop(handle.worker_id, None)
        self._forget_agent(handle.worker_id)
        handle.exited.set()
        self._save_pids()
        self.calls.fail(handle.worker_id, f"the worker of model {handle.config.name!r} exited")
        self.on_exit(handle)

    async def _watch_group(self, handle: WorkerHandle) -> int:
        """A sharded model's ranks: the first to exit ends the group (the others are
        killed: MLX's ring raises on a lost peer, but a frozen one would hold them forever);
        its exit status is the group's."""
        assert handle.process is not None
        ranks = [handle.process, *handle.ranks]
        waits = {asyncio.ensure_future(p.wait()): rank for rank, p in enumerate(ranks)}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if pending and any(task.result() for task in done):
            more, _ = await asyncio.wait(pending, timeout=SETTLE_S)
            done |= more
        # a rank killed by a signal is the cause, not the peers that then lost it and exited
        # with an error (rank 0's own report of the lost peer may have come in first)
        hosts = handle.config.hosts

        def killed(rank: int, code: int) -> bool:
            # over ssh: the remote shell's 128 + signal, or ssh's own 255 (the link lost)
            remote = bool(hosts.ranks) and not runs_here(hosts, rank)
            return code < 0 or (remote and code > 128)

        first = min(done, key=lambda task: (not killed(waits[task], task.result()), waits[task]))
        rank, code = waits[first], first.result()
        killed_by_signal = killed(rank, code)
        if rank and code == 0:  # a clean stop: rank 0 leaves by itself once its frames are out
            leader = next(task for task, r in waits.items() if r == 0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(leader), CLEAN_EXIT_S)
        for process in ranks:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        await asyncio.gather(*waits)
        if rank and not handle.retiring:
            how, where = describe_exit(code), ""
            if hosts.ranks and not runs_here(hosts, rank):
                lost = ", ssh's 255: the machine was not reached, or the rank there was lost"
                how += lost if code == 255 else ""
                where = f" (on {hosts.ranks[rank]}, over ssh)"
            cause = (
                f"rank {rank}{where} of its {len(ranks)}-process group exited "
                f"({how}); the group is restarted as a unit"
            )
            override = killed_by_signal and not handle.killed
            handle.error = cause if override else handle.error or cause
        with contextlib.suppress(OSError):
            (self.run_dir.root / f"ring-{handle.worker_id}.json").unlink()
        return code

    def _forget_agent(self, worker_id: str) -> None:
        folder = self._agents.pop(worker_id, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _ring_range(self, model: str, worker_id: str) -> int:
        """Which of a model's two ring port ranges a new group over several machines takes:
        the one no group of the model still running holds (a reload's old one drains)."""
        held = {
            self._ring_ranges[h.worker_id]
            for h in self.by_id.values()
            if h.config.name == model and h.worker_id in self._ring_ranges
        }
        free = [r for r in (0, 1) if r not in held]
        if not free:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {model!r}: two groups of it still run (one draining): their ring "
                "ports are both in use",
                retry_after=5,
            )
        self._ring_ranges[worker_id] = free[0]
        return free[0]

    def _save_pids(self) -> None:
        pids = (p.pid for h in self.by_id.values() if h.process for p in [h.process, *h.ranks])
        save_pids(self.run_dir.workers_file, pids)
