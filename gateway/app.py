"""The gateway's Litestar application, built by a factory; its lifespan owns the workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import uvicorn
from litestar import Litestar, Request, Response, get
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from gateway.admin import admin_router, create_admin_app
from gateway.api.anthropic.routes import anthropic_router
from gateway.api.audio.routes import audio_router
from gateway.api.errors import error_response
from gateway.api.openai.routes import openai_router
from gateway.api.openai.schemas import ErrorBody
from gateway.api.openapi import documented
from gateway.api.rerank.routes import rerank_router
from gateway.api.responses.routes import responses_router
from gateway.api.serve import InFlight
from gateway.api.tokenize import detokenize, tokenize
from gateway.console.live import LiveFigures
from gateway.console.recent import RecentRequests
from gateway.console.routes import console_handlers, sampling
from gateway.edge.context import RequestContext
from gateway.edge.hosts import HostCheck
from gateway.edge.keys import KeyStore, keys_path
from gateway.edge.logs import access_hook
from gateway.edge.mdns import Advertiser, advertise
from gateway.edge.metrics import Metrics, metrics_route, ready_route
from gateway.edge.middleware import ASGIApp, GatewayMiddleware
from gateway.edge.ratelimit import KeyLimiter
from gateway.errors import GatewayError
from gateway.workers.client import WorkerClient
from gateway.workers.supervisor import Supervisor
from shared.config import Config
from shared.paths import RunDir
from shared.types import ErrorCode
from shared.version import project_version

log = logging.getLogger("gateway")

# Set by `gatewayctl serve` when the app runs in an HTTP server's child process: the pid the
# app must not outlive (its workers, in turn, watch the app's process).
WATCH_PARENT_ENV = "MLX_GATEWAY_PARENT_PID"


@get("/health", operation_class=documented(ErrorBody))
async def health(state: State) -> dict[str, object]:
    workers: WorkerClient = state.workers
    models = {view.name: view.state.value for view in workers.views()}
    return {"status": "ok", "models": models}


def _http_error(request: Request, exc: Exception) -> Response[bytes]:
    """Framework errors (404 route, 405, 413 body too large, ...) in the protocol's shape."""
    if isinstance(exc, GatewayError):
        return error_response(request, exc)
    if isinstance(exc, HTTPException):
        code = {413: ErrorCode.PAYLOAD_TOO_LARGE}.get(exc.status_code, ErrorCode.INVALID_REQUEST)
        message = str(exc.detail)
        if exc.status_code == 413:
            limit = request.app.state.config.server.max_body_bytes
            message = f"request body too large: the limit is {limit} bytes (server.max_body_bytes)"
        response = error_response(request, GatewayError(code, message))
        response.status_code = exc.status_code
        return response
    log.exception("unhandled error", exc_info=exc)
    return error_response(request, GatewayError(ErrorCode.INTERNAL, "internal server error"))


@contextlib.asynccontextmanager
async def _lifespan(app: Litestar) -> AsyncIterator[None]:
    state = app.state
    supervisor: Supervisor = state.supervisor
    admin = await _start_admin(state, supervisor.run_dir)
    sampler = None
    if state.config.server.console:
        sampler = asyncio.create_task(sampling(state.live), name="console-figures")
    advert: Advertiser | None = None
    parent = os.environ.get(WATCH_PARENT_ENV)
    watch = asyncio.create_task(_watch_parent(parent))
    if parent:
        _drain_on_sigterm(supervisor)
    try:
        await supervisor.start()
        advert = await advertise(state.config.server, state.key_store.auth_required)
        yield
    finally:
        if advert is not None:
            await advert.close()
        # Shutdown (SIGTERM): new requests get 503 while in-flight ones drain (or end with
        # an error after server.drain_timeout_s); then the workers and the sockets go.
        watch.cancel()
        if sampler is not None:
            sampler.cancel()
        await supervisor.stop()
        admin.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(state.admin_task, 5)
        supervisor.run_dir.admin_socket.unlink(missing_ok=True)


def _drain_on_sigterm(supervisor: Supervisor) -> None:
    """Under Granian, whose worker waits for open connections before the lifespan's shutdown:
    on SIGTERM drain first (new requests get 503 meanwhile), then let Granian stop (SIGINT)."""
    loop = asyncio.get_running_loop()

    def drain_then_stop() -> None:
        if supervisor.draining:
            return
        task = asyncio.ensure_future(supervisor.stop())
        task.add_done_callback(lambda _: os.kill(os.getpid(), signal.SIGINT))

    loop.add_signal_handler(signal.SIGTERM, drain_then_stop)


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


class GatewayApp:
    """The ASGI app a server runs: the middleware in front of the Litestar application."""

    def __init__(self, litestar: Litestar, asgi: ASGIApp) -> None:
        self.litestar = litestar
        self.state = litestar.state
        self._asgi = asgi

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._asgi(scope, receive, send)


def create_app(config: Config) -> GatewayApp:
    run_dir = RunDir(config.server.run_dir)
    keys = KeyStore(keys_path(config.server.keys_file))
    supervisor = Supervisor(config, run_dir)
    metrics = Metrics(supervisor)
    limiter = KeyLimiter()
    recent = RecentRequests()
    finish_hooks: list[Callable[[RequestContext], None]] = [metrics.observe]
    if config.server.console:
        finish_hooks.append(recent.observe)
    if config.server.access_log:
        finish_hooks.append(access_hook())
    state = State(
        {
            "config": config,
            "supervisor": supervisor,  # the control plane: admin API, lifespan
            "workers": supervisor,  # the request path's face of it (WorkerClient)
            "metrics": metrics,
            # the console's figures, sampled from the metrics, and its recent requests
            "live": LiveFigures(metrics),
            "recent": recent,
            "started_at": time.time(),
            "key_store": keys,
            "inflight": InFlight(),  # requests in flight, for cancel by id
            "limiter": limiter,  # per-key limits (the middleware's; background work too)
            # Called with each finished RequestContext (metrics, access log).
            "finish_hooks": finish_hooks,
        }
    )
    handlers: list[Any] = [
        openai_router(),
        anthropic_router(),
        rerank_router(),
        responses_router(),
        audio_router(config.server),
        tokenize,
        detokenize,
        health,
        metrics_route,
        ready_route,
    ]
    if config.server.admin_http:
        handlers.append(admin_router())
    if config.server.console:
        handlers.extend(console_handlers())
    litestar = Litestar(
        route_handlers=handlers,
        state=state,
        lifespan=[_lifespan],
        exception_handlers={Exception: _http_error},
        request_max_body_size=config.server.max_body_bytes,
        logging_config=None,  # gateway.ctl.server configures logging once for the process
        type_encoders={msgspec.Struct: msgspec.to_builtins},
        openapi_config=OpenAPIConfig(
            title="mlx-gateway",
            version=project_version(),
            description="OpenAI- and Anthropic-compatible API of a local MLX serving gateway",
        ),
    )
    asgi = GatewayMiddleware(
        litestar,
        keys,
        limiter,
        finish_hooks,
        metrics_open=config.server.metrics_open,
        body_timeout_s=config.server.body_read_timeout_s,
        send_timeout_s=config.server.send_timeout_s,
        hosts=HostCheck(config.server.allowed_hosts, config.server.host),
    )
    return GatewayApp(litestar, asgi)
