"""Run the gateway: uvicorn on uvloop with httptools, the app from the factory."""

from __future__ import annotations

import logging
import os

import uvicorn

from gateway.app import create_app
from shared.config import Config
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
        "serving on http://%s:%d, admin socket %s",
        config.server.host,
        config.server.port,
        run_dir.admin_socket,
    )
    try:
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
    finally:
        run_dir.pid_file.unlink(missing_ok=True)
