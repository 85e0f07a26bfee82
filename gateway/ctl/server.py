"""Run the gateway: Granian (Rust HTTP) on uvloop, one worker process running the app.

Granian against uvicorn+httptools on the token-relay path is measured in
docs/lab/2026-11-cpu-serving-runs.md;
`server.http_server = "uvicorn"` keeps uvicorn available. Granian runs the app in a child
process: the resolved config travels to it as JSON in the environment, and the app watches
its parent so that nothing outlives `gatewayctl serve`.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import math
import os
import socket
from pathlib import Path
from typing import Any

import msgspec

from gateway.app import WATCH_PARENT_ENV
from gateway.edge.logs import setup_logging
from shared.config import CONFIG_JSON_ENV, Config, ConfigError
from shared.paths import RunDir, RunDirError

# Beyond server.drain_timeout_s: a stubborn worker gets SIGTERM after 5s more, SIGKILL after 5s.
KILL_MARGIN_S = 15


def kill_timeout(config: Config) -> int:
    """How long the HTTP server waits for the app's shutdown (the drain) before killing it."""
    return math.ceil(config.server.drain_timeout_s) + KILL_MARGIN_S


def tls_files(config: Config) -> tuple[Path, Path] | None:
    """server.tls_cert and server.tls_key, checked to exist before the server starts."""
    cert, key = config.server.tls_cert, config.server.tls_key
    if cert is None or key is None:
        return None
    for name, value in (("server.tls_cert", cert), ("server.tls_key", key)):
        if not Path(value).expanduser().is_file():
            raise ConfigError(f"{name}: no such file: {value}")
    return Path(cert).expanduser(), Path(key).expanduser()


def serve(config: Config) -> None:
    setup_logging(config.server.log_level, config.server.log_format)
    log = logging.getLogger("gateway")
    try:
        tls = tls_files(config)
    except ConfigError as exc:
        raise SystemExit(f"gatewayctl: {exc}") from None
    run_dir = RunDir(config.server.run_dir)
    try:
        run_dir.create()
    except RunDirError as exc:
        raise SystemExit(f"gatewayctl: {exc}") from None
    lock = _own(run_dir)  # held for the gateway's life (closed with the process)
    try:
        _port_free(config.server.host, config.server.port)
    except SystemExit:
        lock.close()
        raise
    run_dir.pid_file.write_text(str(os.getpid()))
    for model in config.models:
        note = " (random-weight demo model: output is gibberish by design)" if model.is_demo else ""
        log.info("model %s <- %s%s", model.name, model.source, note)
    log.info(
        "serving on %s://%s:%d (%s), admin socket %s",
        "https" if tls else "http",
        config.server.host,
        config.server.port,
        config.server.http_server,
        run_dir.admin_socket,
    )
    if config.server.console:
        host = config.server.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        shown = f"[{shown}]" if ":" in shown else shown
        scheme = "https" if tls else "http"
        log.info("console: %s://%s:%d/console", scheme, shown, config.server.port)
    try:
        if config.server.http_server == "uvicorn":
            _uvicorn(config, tls)
        else:
            _granian(config, tls)
    finally:
        run_dir.pid_file.unlink(missing_ok=True)


def _own(run_dir: RunDir) -> Any:
    """The run directory, for this gateway alone: a second gateway on it would take its
    sockets and end its workers as leftovers."""
    lock = open(run_dir.root / "gateway.lock", "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        pid = run_dir.pid_file.read_text().strip() if run_dir.pid_file.exists() else "?"
        raise SystemExit(
            f"gatewayctl: another gateway (pid {pid}) serves from {run_dir.root}; stop it, "
            "or give this one another --run-dir"
        ) from None
    os.set_inheritable(lock.fileno(), False)
    return lock


def _port_free(host: str, port: int) -> None:
    """The port, checked to be free (a server that shares ports would start beside another
    one, and the kernel would split the requests between them)."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"gatewayctl: the port must be 0-65535, not {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no user
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise SystemExit(f"gatewayctl: {host}:{port} is in use already") from None
            raise SystemExit(f"gatewayctl: cannot serve on {host}:{port}: {exc}") from None


def _granian(config: Config, tls: tuple[Path, Path] | None) -> None:
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.http import HTTP1Settings

    os.environ[CONFIG_JSON_ENV] = msgspec.json.encode(config).decode()
    os.environ[WATCH_PARENT_ENV] = str(os.getpid())
    Granian(
        "gateway.asgi:app",
        factory=True,
        address=config.server.host,
        port=config.server.port,
        interface=Interfaces.ASGI,
        # HTTP/1.1 only: with HTTP/2 offered too, a connection that sends nothing is never
        # timed out (the protocol is sniffed first, with no timer) and holds one of
        # Granian's connections (backpressure) for good.
        http=HTTPModes.http1,
        http1_settings=HTTP1Settings(
            header_read_timeout=math.ceil(config.server.header_read_timeout_s * 1000)
        ),
        workers=1,
        loop=Loops.uvloop,
        log_level=config.server.log_level,  # type: ignore[arg-type]
        log_access=False,
        # SIGTERM: the worker's lifespan drains the models; Granian must outwait it.
        workers_kill_timeout=kill_timeout(config),
        ssl_cert=tls[0] if tls else None,
        ssl_key=tls[1] if tls else None,
    ).serve()


def _uvicorn(config: Config, tls: tuple[Path, Path] | None) -> None:
    import uvicorn

    from gateway.app import create_app

    app = create_app(config)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM uvicorn waits for open connections before the lifespan's shutdown:
        start the drain first, so in-flight requests finish (or end) within drain_timeout_s."""

        async def shutdown(self, sockets: Any = None) -> None:
            drain = asyncio.ensure_future(app.state.supervisor.stop())
            await super().shutdown(sockets)
            await drain
            # Drained cleanly: exit 0 rather than re-raise SIGTERM (uvicorn's default).
            self._captured_signals.clear()

    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            loop="uvloop",
            http="httptools",
            log_level=config.server.log_level,
            access_log=False,
            timeout_graceful_shutdown=kill_timeout(config),
            ssl_certfile=tls[0] if tls else None,
            ssl_keyfile=tls[1] if tls else None,
        )
    )
    server.run()
