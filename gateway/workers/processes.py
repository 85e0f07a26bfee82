"""Worker processes: spawning one for a model, waiting for its Ready, signalling it, and
noticing its exit. Each worker is known by its id; the pids of those alive are saved for a
restarted gateway to reap (leftovers). What an exit means is for the caller (`on_exit`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import uuid
from collections.abc import Callable

import msgspec

from gateway.errors import GatewayError
from gateway.workers.control import ControlCalls
from gateway.workers.leftovers import save_pids
from gateway.workers.slots import WorkerHandle, describe_exit
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.blas import worker_env
from shared.config import ModelConfig, ServerConfig
from shared.paths import RunDir
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.processes")

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
        device_kind: str,
        on_exit: Callable[[WorkerHandle], None],
        command: Command | None = None,
    ) -> None:
        self.server = server
        self.run_dir = run_dir
        self.transport = transport
        self.calls = calls
        self.tasks = tasks
        self.device_kind = device_kind
        self.on_exit = on_exit
        self.command = command or self._worker_command
        self.by_id: dict[str, WorkerHandle] = {}
        self._serial = itertools.count(1)

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self.by_id.get(worker_id)

    def alive(self) -> list[WorkerHandle]:
        return list(self.by_id.values())

    def _worker_command(self, worker_id: str, model_json: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "worker",
            "--id",
            worker_id,
            "--requests",
            self.transport.requests_addr,
            "--outputs",
            self.transport.outputs_addr,
            "--model",
            model_json,
        ]

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
        log_file = open(self.run_dir.worker_log(model.name), "ab")  # noqa: SIM115
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=worker_env(server.blas, server.blas_threads, device=self.device_kind),
                start_new_session=True,
            )
        finally:
            log_file.close()
        handle = WorkerHandle(model, worker_id, process, restart=restart)
        self.by_id[worker_id] = handle
        self._save_pids()
        self.tasks.spawn(self._watch_exit(handle))
        log.info("model %s: worker %s spawned (pid %d)", model.name, worker_id, process.pid)
        return handle

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
        with contextlib.suppress(ProcessLookupError):
            handle.process.send_signal(sig)
        try:
            await asyncio.wait_for(handle.exited.wait(), grace or 0.001)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                handle.process.kill()
            await handle.exited.wait()

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        assert handle.process is not None
        handle.exit_code = await handle.process.wait()
        self.by_id.pop(handle.worker_id, None)
        handle.exited.set()
        self._save_pids()
        self.calls.fail(handle.worker_id, f"the worker of model {handle.config.name!r} exited")
        self.on_exit(handle)

    def _save_pids(self) -> None:
        save_pids(self.run_dir.workers_file, (h.pid for h in self.by_id.values()))
