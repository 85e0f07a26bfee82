"""ASGI factory for running the gateway under any ASGI server (config from the environment).

uvicorn --factory gateway.asgi:app --loop uvloop --http httptools
granian --interface asgi --factory gateway.asgi:app --loop uvloop
"""

from __future__ import annotations

import os

import msgspec

from gateway.app import GatewayApp, create_app
from gateway.edge.logs import setup_logging
from shared.config import CONFIG_JSON_ENV, Config, load_config


def app() -> GatewayApp:
    """Config: the JSON that `gatewayctl serve` resolved, else the usual file/env lookup."""
    resolved = os.environ.get(CONFIG_JSON_ENV)
    config = msgspec.json.decode(resolved, type=Config) if resolved else load_config()
    setup_logging(config.server.log_level, config.server.log_format)
    return create_app(config)
