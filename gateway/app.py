"""The gateway's Litestar application, built by a factory; its lifespan owns the workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import msgspec
import uvicorn
from litestar import Litestar, Request, Response, get
from litestar.datastructures import State
from litestar.exceptions import HTTPException

from gateway.admin import create_admin_app
from gateway.errors import GatewayError
from gateway.openai.routes import error_response, openai_router
from gateway.supervisor import Supervisor
from shared.config import Config
from shared.paths import RunDir
from shared.types import ErrorCode

log = logging.getLogger("gateway")

# Set by `gatewayctl serve` when the app runs in an HTTP server's child process: the pid the
# app must not outlive (its workers, in turn, watch the app's process).
WATCH_PARENT_ENV = "MLX_GATEWAY_PARENT_PID"


@get("/health")
async def health(state: State) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    models = {name: supervisor.state_of(name).value for name in supervisor.models}
    return {"status": "ok", "models": models}


def _http_error(request: Request, exc: Exception) -> Response[bytes]:
    """Framework errors (404 route, 405, 413 body too large, ...) in OpenAI's shape."""
    if isinstance(exc, HTTPException):
        code = ErrorCode.INVALID_REQUEST
        error = GatewayError(code, str(exc.detail))
        response = error_response(request, error)
        response.status_code = exc.status_code
        return response
    log.exception("unhandled error", exc_info=exc)
    return error_response(request, GatewayError(ErrorCode.INTERNAL, "internal server error"))


@contextlib.asynccontextmanager
async def _lifespan(app: Litestar) -> AsyncIterator[None]:
    state = app.state
    supervisor: Supervisor = state.supervisor
    admin = await _start_admin(state, supervisor.run_dir)
    watch = asyncio.create_task(_watch_parent(os.environ.get(WATCH_PARENT_ENV)))
    try:
        await supervisor.start()
        yield
    finally:
        watch.cancel()
        await supervisor.stop()
        admin.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(state.admin_task, 5)


async def _watch_parent(pid: str | None) -> None:
    if not pid:
        return
    while os.getppid() == int(pid):
        await asyncio.sleep(1.0)
    log.error("gatewayctl (pid %s) is gone; exiting, workers follow", pid)
    os._exit(1)


class _NestedServer(uvicorn.Server):
    """A second uvicorn server in the same loop: the main server owns the signals."""

    def capture_signals(self) -> contextlib.nullcontext[None]:  # type: ignore[override]
        return contextlib.nullcontext()


async def _start_admin(state: State, run_dir: RunDir) -> uvicorn.Server:
    run_dir.create()
    path = run_dir.admin_socket
    path.unlink(missing_ok=True)
    config = uvicorn.Config(
        create_admin_app(state), uds=str(path), log_level="warning", lifespan="off"
    )
    server = _NestedServer(config)
    state.admin_task = asyncio.create_task(server.serve(), name="admin-server")
    for _ in range(200):  # bounded: the socket appears within milliseconds
        if path.exists():
            os.chmod(path, 0o600)
            break
        await asyncio.sleep(0.01)
    return server


def create_app(config: Config) -> Litestar:
    run_dir = RunDir(config.server.run_dir)
    state = State(
        {"config": config, "supervisor": Supervisor(config, run_dir), "started_at": time.time()}
    )
    return Litestar(
        route_handlers=[openai_router(), health],
        state=state,
        lifespan=[_lifespan],
        exception_handlers={Exception: _http_error},
        request_max_body_size=config.server.max_body_bytes,
        logging_config=None,  # gateway.server configures logging once for the process
        type_encoders={msgspec.Struct: msgspec.to_builtins},
    )
