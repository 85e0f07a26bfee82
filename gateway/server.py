"""Run the gateway: Granian (Rust HTTP) on uvloop, one worker process running the app.

Granian against uvicorn+httptools on the token-relay path is measured in docs/benchmarks.md;
`server.http_server = "uvicorn"` keeps uvicorn available. Granian runs the app in a child
process: the resolved config travels to it as JSON in the environment, and the app watches
its parent so that nothing outlives `gatewayctl serve`.
"""

from __future__ import annotations

import logging
import os

import msgspec

from gateway.app import WATCH_PARENT_ENV
from shared.config import CONFIG_JSON_ENV, Config
from shared.paths import RunDir

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def serve(config: Config) -> None:
    level = config.server.log_level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    log = logging.getLogger("gateway")
    run_dir = RunDir(config.server.run_dir)
    run_dir.create()
    run_dir.pid_file.write_text(str(os.getpid()))
    for model in config.models:
        note = " (random-weight demo model: output is gibberish by design)" if model.is_demo else ""
        log.info("model %s <- %s%s", model.name, model.source, note)
    log.info(
        "serving on http://%s:%d (%s), admin socket %s",
        config.server.host,
        config.server.port,
        config.server.http_server,
        run_dir.admin_socket,
    )
    try:
        if config.server.http_server == "uvicorn":
            _uvicorn(config)
        else:
            _granian(config)
    finally:
        run_dir.pid_file.unlink(missing_ok=True)


def _granian(config: Config) -> None:
    from granian import Granian
    from granian.constants import Interfaces, Loops

    os.environ[CONFIG_JSON_ENV] = msgspec.json.encode(config).decode()
    os.environ[WATCH_PARENT_ENV] = str(os.getpid())
    Granian(
        "gateway.asgi:app",
        factory=True,
        address=config.server.host,
        port=config.server.port,
        interface=Interfaces.ASGI,
        workers=1,
        loop=Loops.uvloop,
        log_level=config.server.log_level,  # type: ignore[arg-type]
        log_access=False,
        workers_kill_timeout=30,
    ).serve()


def _uvicorn(config: Config) -> None:
    import uvicorn

    from gateway.app import create_app

    uvicorn.run(
        create_app(config),
        host=config.server.host,
        port=config.server.port,
        loop="uvloop",
        http="httptools",
        log_level=config.server.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
