"""ASGI factory for running the gateway under any ASGI server (config from the environment).

uvicorn --factory gateway.asgi:app --loop uvloop --http httptools
granian --interface asgi --factory gateway.asgi:app --loop uvloop
"""

from __future__ import annotations

from litestar import Litestar

from gateway.app import create_app
from shared.config import load_config


def app() -> Litestar:
    return create_app(load_config())
